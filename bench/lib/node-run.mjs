// One benchmark run in its own Node process, so its peak RSS is its own:
//   node bench/lib/node-run.mjs '<spec as JSON>'
// prints one line `BENCH_RESULT <json>`. The spec comes from bench.mjs (see runSpec there).
// onnx-generate loads the package in ../../pkg (or --pkg's folder) with Model.load: the ONNX graph
// (and a speech model's encoder) as a Blob of the file (fs.openAsBlob: streamed into the engine, as
// a page's fetch is), the rest as bytes read from disk;
// transformers.js runs on onnxruntime-web's wasm backend (not onnxruntime-node), with
// `threads` wasm threads.
import { existsSync, openAsBlob } from "node:fs";
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { readWav } from "../../js-tests/wav.mjs";
import {
  runOnnxGenerate,
  runOnnxGenerateBatches,
  runOnnxGenerateTranscribe,
  runTransformersJs,
  runTransformersJsTranscribe,
} from "./engines.mjs";

const spec = JSON.parse(process.argv[2]);
const root = new URL("../../", import.meta.url);
// A speech model's clip, decoded once before either engine starts (not timed).
const audio = spec.speech ? readWav(await readFile(join(spec.model.dir, "audio.wav"))) : null;

async function onnxGenerate() {
  const pkg = await import(new URL(`${spec.pkg}/onnx_generate.js`, root));
  const dir = spec.model.dir;
  const optional = async (name) => (existsSync(join(dir, name)) ? readFile(join(dir, name)) : undefined);
  let wasmMemory, wasmFile;
  const load = async () => {
    wasmFile = pkg.wasmFile();
    const exports = pkg.initSync({ module: await readFile(new URL(`${spec.pkg}/${wasmFile}`, root)) });
    wasmMemory = exports.memory;
    return pkg.Model.load({
      model: await openAsBlob(join(dir, spec.model.onnx)),
      external_data: await optional(`${spec.model.onnx}.data`),
      encoder: spec.speech ? await openAsBlob(join(dir, spec.speech.encoder)) : undefined,
      encoder_external_data: spec.speech ? await optional(`${spec.speech.encoder}.data`) : undefined,
      preprocessor_config: await optional("preprocessor_config.json"),
      config: await readFile(join(dir, "config.json")),
      generation_config: await optional("generation_config.json"),
      tokenizer: await readFile(join(dir, "tokenizer.json")),
      tokenizer_config: await optional("tokenizer_config.json"),
      chat_template: await optional("chat_template.jinja"),
    });
  };
  const result = spec.batch
    ? await runOnnxGenerateBatches({ load, rowsList: spec.batch, newTokens: spec.newTokens })
    : spec.speech
      ? await runOnnxGenerateTranscribe({ load, ...audio, language: spec.speech.language, budgetMs: spec.budgetMs })
      : await runOnnxGenerate({ load, input: spec.input, newTokens: spec.newTokens, sample: spec.sample, budgetMs: spec.budgetMs });
  result.wasm_memory_mb = wasmMemory.buffer.byteLength / 2 ** 20;
  result.wasm_file = wasmFile;
  return result;
}

async function transformersJs() {
  // transformers.js uses the onnxruntime given under this symbol instead of onnxruntime-node.
  const ort = await import("onnxruntime-web");
  ort.env.wasm.numThreads = spec.threads;
  ort.env.wasm.wasmPaths = new URL("../node_modules/onnxruntime-web/dist/", import.meta.url).href;
  globalThis[Symbol.for("onnxruntime")] = ort;
  const tjs = await import("@huggingface/transformers");
  tjs.env.allowRemoteModels = false;
  tjs.env.localModelPath = spec.modelsRoot;
  const common = {
    tjs,
    modelId: spec.model.name,
    dtype: spec.model.tjsDtype,
    // "auto" keeps transformers.js from mapping the device to onnxruntime-node's providers.
    device: "auto",
    sessionOptions: { executionProviders: ["wasm"] },
    budgetMs: spec.budgetMs,
  };
  if (spec.speech) return runTransformersJsTranscribe({ ...common, ...audio, language: spec.speech.language });
  return runTransformersJs({
    ...common,
    input: spec.input,
    chatTemplate: spec.chatTemplate,
    newTokens: spec.newTokens,
    sample: spec.sample,
  });
}

const cpu0 = process.cpuUsage();
const t0 = performance.now();
const result = spec.engine === "onnx-generate" ? await onnxGenerate() : await transformersJs();
const cpu = process.cpuUsage(cpu0);
result.peak_mb = process.resourceUsage().maxRSS / 1024;
// CPU time over wall time of the whole run: about 1 for one busy thread, more with threads.
result.cpu_per_wall = (cpu.user + cpu.system) / 1000 / (performance.now() - t0);
console.log(`BENCH_RESULT ${JSON.stringify(result)}`);
process.exit(0);
