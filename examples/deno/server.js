// An OpenAI-style completions server with Deno.serve over onnx-generate's wasm package (the
// `--target web` build in pkg/, loaded with initSync). The endpoints are those of the Worker
// (examples/openai/openai.js serves both).
//
//   deno run --allow-read --allow-net=127.0.0.1 examples/deno/server.js \
//     [--model DIR] [--variant q4] [--model-id NAME] [--port 8000] [--debug]
//
// DIR is a model folder (flat or transformers.js layout; default: the tiny llama fixture,
// which gets the SmolLM2 chat template of tests/fixtures/chat so that chat requests work).
// Listens on 127.0.0.1 only; `--port 0` picks a free port. Prints `listening on URL` once ready.
import { initSync, Model, wasmFile } from "../../pkg/onnx_generate.js";
import { createHandler } from "../openai/openai.js";

const root = new URL("../../", import.meta.url);
const args = { port: "8000", debug: false };
for (let i = 0; i < Deno.args.length; i++) {
  const a = Deno.args[i];
  if (a === "--debug") args.debug = true;
  else if (["--model", "--variant", "--model-id", "--port"].includes(a) && i + 1 < Deno.args.length) args[a.slice(2)] = Deno.args[++i];
  else throw new Error(`unknown argument ${a}; usage: server.js [--model DIR] [--variant V] [--model-id NAME] [--port N] [--debug]`);
}

const wasm = initSync({ module: Deno.readFileSync(new URL(`pkg/${wasmFile()}`, root)) });

const fixture = new URL("tests/fixtures/models/llama/", root);
const dir = args.model ? new URL(`file://${await Deno.realPath(args.model)}/`) : fixture;
const exists = (url) => Deno.stat(url).then(() => true, () => false);

/** The files of a model folder for Model.load (flat or transformers.js layout). */
async function modelFiles(dir) {
  const suffix = args.variant && args.variant !== "fp32" ? `_${args.variant}` : "";
  const names = [`onnx/model${suffix}.onnx`, `model${suffix}.onnx`, `onnx/decoder_model_merged${suffix}.onnx`, `decoder_model_merged${suffix}.onnx`];
  let onnx = null;
  for (const n of names) {
    if (await exists(new URL(n, dir))) {
      onnx = n;
      break;
    }
  }
  if (!onnx) throw new Error(`no ONNX model in ${dir.pathname} (tried ${names.join(", ")})`);
  const files = { model_name: onnx.split("/").pop(), model: await Deno.readFile(new URL(onnx, dir)) };
  const optional = {
    external_data: [`${onnx}.data`, `${onnx}_data`],
    config: ["config.json"],
    generation_config: ["generation_config.json"],
    tokenizer: ["tokenizer.json"],
    tokenizer_config: ["tokenizer_config.json"],
    chat_template: ["chat_template.jinja"],
  };
  for (const [key, candidates] of Object.entries(optional)) {
    for (const n of candidates) {
      if (await exists(new URL(n, dir))) {
        files[key] = await Deno.readFile(new URL(n, dir));
        break;
      }
    }
  }
  if (dir.href === fixture.href) {
    files.chat_template = await Deno.readFile(new URL("tests/fixtures/chat/smollm2.jinja", root));
  }
  return files;
}

const modelId = args["model-id"] ?? (args.model ? dir.pathname.replace(/\/$/, "").split("/").pop() : "llama-fixture");
// Load before listening, so that `listening on` means ready.
const memoryBefore = wasm.memory.buffer.byteLength;
const model = await Model.load(await modelFiles(dir));
console.log(`loaded ${modelId}: wasm memory ${memoryBefore} -> ${wasm.memory.buffer.byteLength} bytes`);
const handle = createHandler({
  modelId,
  debug: args.debug,
  memoryBytes: () => wasm.memory.buffer.byteLength,
  loadModel: () => model,
});

Deno.serve(
  {
    hostname: "127.0.0.1",
    port: Number(args.port),
    onListen: ({ hostname, port }) => console.log(`listening on http://${hostname}:${port}/ (model ${modelId})`),
  },
  handle,
);
