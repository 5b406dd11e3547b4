// The benchmark's browser side (served by bench.mjs with COOP/COEP headers, so wasm threads
// work): onnx-generate from /pkg/ (1 thread) or /pkg-threads/ (the threads build, more),
// transformers.js' browser bundle from /tjs/ with onnxruntime-web's wasm files from /ort/,
// models from /models/<name>/ (a speech model's clip as /models/<name>/audio.wav, decoded by
// the tests' WAV reader from /js-tests/).
import {
  runOnnxGenerate,
  runOnnxGenerateBatches,
  runOnnxGenerateTranscribe,
  runTransformersJs,
  runTransformersJsTranscribe,
} from "./engines.mjs";
import { measureBandwidth } from "./bandwidth.mjs";

/** `{ pcm, rate }` of a speech model's clip, fetched and decoded before the run (not timed). */
async function audio(spec) {
  const { readWav } = await import("/js-tests/wav.mjs");
  const response = await fetch(`/models/${spec.model.name}/audio.wav`);
  if (!response.ok) throw new Error(`audio.wav of ${spec.model.name}: HTTP ${response.status}`);
  return readWav(new Uint8Array(await response.arrayBuffer()));
}

async function onnxGenerate(spec) {
  const dir = spec.threads > 1 ? "/pkg-threads" : "/pkg";
  const pkg = await import(`${dir}/onnx_generate.js`);
  let memory, wasmFile;
  const load = async () => {
    wasmFile = pkg.wasmFile();
    ({ memory } = await pkg.default({ module_or_path: `${dir}/${wasmFile}` }));
    // The page's thread computes its share of each matmul: n threads = n - 1 workers.
    if (spec.threads > 1) {
      await pkg.initThreadPool(spec.threads - 1);
      if (spec.parallelThreshold !== null) pkg.setParallelThreshold(spec.parallelThreshold);
    }
    return pkg.Model.fromUrl(`/models/${spec.model.name}/`, { variant: spec.model.ogVariant });
  };
  const clip = spec.speech ? await audio(spec) : null;
  const result = spec.batch
    ? await runOnnxGenerateBatches({ load, rowsList: spec.batch, newTokens: spec.newTokens })
    : spec.speech
      ? await runOnnxGenerateTranscribe({ load, ...clip, language: spec.speech.language, budgetMs: spec.budgetMs })
      : await runOnnxGenerate({ load, input: spec.input, newTokens: spec.newTokens, sample: spec.sample, budgetMs: spec.budgetMs });
  result.wasm_memory_mb = memory.buffer.byteLength / 2 ** 20;
  result.wasm_file = wasmFile;
  return result;
}

async function transformersJs(spec) {
  const clip = spec.speech ? await audio(spec) : null;
  const tjs = await import("/tjs/transformers.js");
  tjs.env.allowRemoteModels = false;
  tjs.env.allowLocalModels = true; // false by default in browsers
  tjs.env.localModelPath = "/models/";
  tjs.env.useBrowserCache = false;
  const wasm = tjs.env.backends.onnx.wasm;
  wasm.numThreads = spec.threads;
  // The files transformers.js would fetch from its CDN, served here.
  wasm.wasmPaths = {
    mjs: new URL("/ort/ort-wasm-simd-threaded.asyncify.mjs", location.href).href,
    wasm: new URL("/ort/ort-wasm-simd-threaded.asyncify.wasm", location.href).href,
  };
  const common = { tjs, modelId: spec.model.name, dtype: spec.model.tjsDtype, device: "wasm", budgetMs: spec.budgetMs };
  if (spec.speech) return runTransformersJsTranscribe({ ...common, ...clip, language: spec.speech.language });
  return runTransformersJs({ ...common, input: spec.input, chatTemplate: spec.chatTemplate, newTokens: spec.newTokens, sample: spec.sample });
}

window.benchRun = async (spec) => {
  const result = spec.engine === "onnx-generate" ? await onnxGenerate(spec) : await transformersJs(spec);
  result.cross_origin_isolated = self.crossOriginIsolated;
  return result;
};

window.benchBandwidth = (wasm, threads, megabytes) =>
  measureBandwidth({
    wasm: new Uint8Array(wasm),
    threads,
    megabytes,
    spawn: async () => new Worker(new URL("./bandwidth-worker.mjs", import.meta.url), { type: "module" }),
  });

window.benchReady = true;
