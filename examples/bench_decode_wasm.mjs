// Decode speed and memory of SmolLM2-135M-Instruct in wasm (Node, one thread), over the package
// in pkg/ (scripts/build-wasm.sh): the wasm counterpart of examples/bench_decode.rs.
//
//   node examples/bench_decode_wasm.mjs [--variant fp32|fp16|q4|int8] [--models DIR] [--tokens N]
//
// Prints load time, time to first token, decode tokens/s (tokens 2..N), the text, and the peak
// of the wasm memory and of the process RSS (sampled after each token).
import { readFile } from "node:fs/promises";
import { initSync, Model, wasmFile } from "../pkg/onnx_generate.js";

const args = process.argv.slice(2);
const opt = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
};
const variant = opt("--variant", "fp32");
const root = opt("--models", new URL("../.realmodels", import.meta.url).pathname);
const tokens = Number(opt("--tokens", "64"));
const onnx = { fp32: "model.onnx", fp16: "model_fp16.onnx", q4: "model_q4.onnx", int8: "model_quantized.onnx" }[variant];
if (!onnx) throw new Error(`unknown variant ${variant}`);
const dir = `${root}/smollm2/tjs`;

const wasm = await readFile(new URL(`../pkg/${wasmFile()}`, import.meta.url));
const exports = initSync({ module: wasm });
let peakRss = 0;
const sample = () => { peakRss = Math.max(peakRss, process.memoryUsage().rss); };

let t0 = performance.now();
const model = await Model.load({
  model: await readFile(`${dir}/onnx/${onnx}`),
  config: await readFile(`${dir}/config.json`),
  generation_config: await readFile(`${dir}/generation_config.json`),
  tokenizer: await readFile(`${dir}/tokenizer.json`),
  chat_template: await readFile(`${dir}/chat_template.jinja`),
});
sample();
const load = (performance.now() - t0) / 1000;
const times = [];
t0 = performance.now();
const result = await model.generate([{ role: "user", content: "What is the capital of France?" }], {
  max_new_tokens: tokens,
  min_new_tokens: tokens,
  on_token: () => { times.push(performance.now()); sample(); },
});
const first = (times[0] - t0) / 1000;
const steps = times.slice(1).map((t, i) => t - times[i]).sort((a, b) => a - b);
const median = steps[Math.floor(steps.length / 2)];
const mean = (times[times.length - 1] - times[0]) / (times.length - 1);
const wasmMib = exports.memory.buffer.byteLength / 2 ** 20;
console.log(
  `${variant.padEnd(5)} load ${load.toFixed(2)}s  first token ${first.toFixed(2)}s  ` +
  `decode ${(1000 / mean).toFixed(1)} tok/s (median ${median.toFixed(1)} ms/tok)  ` +
  `wasm memory ${wasmMib.toFixed(0)} MiB  peak RSS ${(peakRss / 2 ** 20).toFixed(0)} MiB`,
);
console.log(`  ids ${result.token_ids.slice(0, 16).join(" ")} ... text: ${JSON.stringify(result.text.slice(0, 80))}`);
