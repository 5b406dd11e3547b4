// The onnx-generate Worker: OpenAI-style completions (examples/openai/openai.js) over the wasm
// package built for the web target (pkg/), instantiated with initSync from the module wrangler
// compiled at upload. The model is loaded on the first request that needs it and stays loaded
// for the isolate's lifetime:
// * env.MODEL_BUCKET (an R2 binding): the files of a model folder under env.MODEL_PREFIX;
// * env.MODEL_URL: a model folder served over HTTP (Model.fromUrl, env.MODEL_VARIANT);
// * otherwise the tiny test fixture bundled into the Worker (src/fixture.js).
import { initSync, Model } from "../../../pkg/onnx_generate.js";
import wasmModule from "../../../pkg/onnx_generate_bg.wasm";
import { createHandler } from "../../openai/openai.js";
import { fixtureFiles } from "./fixture.js";

const wasm = initSync({ module: wasmModule });

/** A model folder in R2: the same names as a folder (flat, or ONNX files under onnx/). */
async function loadFromR2(bucket, prefix, variant) {
  const suffix = variant && variant !== "fp32" ? `_${variant}` : "";
  const get = async (key) => {
    const object = await bucket.get(prefix + key);
    return object ? new Uint8Array(await object.arrayBuffer()) : null;
  };
  let modelName = null;
  let model = null;
  for (const name of [`onnx/model${suffix}.onnx`, `model${suffix}.onnx`]) {
    model = await get(name);
    if (model) {
      modelName = name;
      break;
    }
  }
  if (!model) throw new Error(`no model${suffix}.onnx under ${prefix} in the R2 bucket`);
  const files = { model, model_name: modelName.split("/").pop() };
  const names = {
    external_data: [`${modelName}_data`, `${modelName}.data`],
    config: "config.json",
    generation_config: "generation_config.json",
    tokenizer: "tokenizer.json",
    tokenizer_config: "tokenizer_config.json",
    chat_template: "chat_template.jinja",
  };
  for (const [file, keys] of Object.entries(names)) {
    for (const key of [keys].flat()) {
      const bytes = await get(key);
      if (bytes) {
        files[file] = bytes;
        break;
      }
    }
  }
  return Model.load(files);
}

function loadModel(env) {
  if (env.MODEL_BUCKET) return loadFromR2(env.MODEL_BUCKET, env.MODEL_PREFIX ?? "", env.MODEL_VARIANT);
  if (env.MODEL_URL) return Model.fromUrl(env.MODEL_URL, { variant: env.MODEL_VARIANT });
  return Model.load(fixtureFiles());
}

let handle = null;

export default {
  fetch(request, env, ctx) {
    handle ??= createHandler({
      modelId: env.MODEL_ID ?? "llama-fixture",
      debug: env.DEBUG_STATS === "1",
      memoryBytes: () => wasm.memory.buffer.byteLength,
      loadModel: () => loadModel(env),
    });
    return handle(request, ctx);
  },
};
