// Where onnx-generate's time goes in Node: loads a model (several times if asked, each after
// freeing the previous one), runs prompts on the last load, and prints per phase the wall time,
// CPU time / wall time (above 1: V8's background compilation or GC ran beside the engine), RSS
// and wasm memory. With --profile it records V8 CPU profiles (node:inspector) of the first load
// and of prompt --profile-prompt (the first by default; a later one shows decoding without
// V8's tier-up of the first), writes them (open them in Chromium's DevTools) and prints the
// functions with the most time, inclusive and self.
//
//   node bench/profile.mjs [--pkg pkg] [--model DIR] [--onnx FILE] [--loads N] [--prompts N]
//                          [--tokens N] [--profile DIR] [--profile-prompt N] [--top N]
//
// Defaults: ../pkg, the SmolLM2 files of .realmodels/smollm2/tjs (onnx/model.onnx) when built,
// otherwise the tiny fixture tests/fixtures/models/llama; 1 load, 2 prompts of 16 tokens.
// Function names need a wasm with its name section (release builds strip it):
//   CARGO_PROFILE_RELEASE_STRIP=false cargo build --release --target wasm32-unknown-unknown --lib
//   wasm-bindgen --target web --keep-debug --out-dir pkg-named --out-name onnx_generate \
//     target/wasm32-unknown-unknown/release/onnx_generate.wasm      (then --pkg pkg-named)
import { existsSync, mkdirSync, openAsBlob, writeFileSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { Session } from "node:inspector/promises";
import { join, resolve } from "node:path";
import { parseArgs } from "node:util";

const root = resolve(new URL("..", import.meta.url).pathname);
const { values: opt } = parseArgs({
  options: {
    pkg: { type: "string", default: "pkg" },
    model: { type: "string" },
    onnx: { type: "string" },
    loads: { type: "string", default: "1" },
    prompts: { type: "string", default: "2" },
    tokens: { type: "string", default: "16" },
    profile: { type: "string" },
    "profile-prompt": { type: "string", default: "1" },
    top: { type: "string", default: "25" },
  },
});
const real = join(root, ".realmodels/smollm2/tjs");
const dir = resolve(root, opt.model ?? (existsSync(real) ? real : "tests/fixtures/models/llama"));
const onnx = opt.onnx ?? (existsSync(join(dir, "onnx/model.onnx")) ? "onnx/model.onnx" : "model.onnx");
const pkgDir = resolve(root, opt.pkg);
const profiledPrompt = Number(opt["profile-prompt"]);
if (!(Number.isInteger(profiledPrompt) && profiledPrompt >= 1 && profiledPrompt <= opt.prompts)) {
  const expected = `expected a prompt from 1 to --prompts (${opt.prompts})`;
  throw new Error(`--profile-prompt: ${opt["profile-prompt"]}; ${expected}`);
}
for (const [what, path] of [["--pkg", join(pkgDir, "onnx_generate.js")], ["--model", join(dir, onnx)]]) {
  if (!existsSync(path)) throw new Error(`${what}: ${path} not found`);
}

const session = opt.profile ? new Session() : null;
if (session) {
  mkdirSync(opt.profile, { recursive: true });
  session.connect();
  await session.post("Profiler.enable");
  await session.post("Profiler.setSamplingInterval", { interval: 250 });
}

/** Runs `f`, printing its wall time, CPU / wall, RSS and wasm memory; profiled as `name`. */
let memory;
async function phase(name, profiled, f) {
  if (profiled) await session.post("Profiler.start");
  const cpu = process.cpuUsage();
  const t = performance.now();
  const result = await f();
  const wall = performance.now() - t;
  const used = process.cpuUsage(cpu);
  const mb = (b) => (b / 2 ** 20).toFixed(0);
  console.log(
    `${name}: ${wall.toFixed(0)} ms, CPU/wall ${((used.user + used.system) / 1000 / wall).toFixed(2)}, ` +
      `RSS ${mb(process.memoryUsage().rss)} MB, wasm memory ${memory ? mb(memory.buffer.byteLength) : 0} MB`,
  );
  if (profiled) {
    const { profile } = await session.post("Profiler.stop");
    const file = join(opt.profile, `${name.replace(/\W+/g, "-")}.cpuprofile`);
    writeFileSync(file, JSON.stringify(profile));
    summarize(profile, file);
  }
  return result;
}

/** The functions of a CPU profile with the most time: inclusive (in the stack) and self. */
function summarize(profile, file) {
  const byId = new Map(profile.nodes.map((n) => [n.id, n]));
  const parent = new Map();
  for (const n of profile.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
  const inclusive = new Map();
  const self = new Map();
  let total = 0;
  const name = (id) => byId.get(id).callFrame.functionName.replace(/::h[0-9a-f]{16}$/, "") || "(anonymous)";
  profile.samples.forEach((id, i) => {
    const ms = (profile.timeDeltas[i + 1] ?? 0) / 1000;
    total += ms;
    self.set(name(id), (self.get(name(id)) ?? 0) + ms);
    const seen = new Set();
    for (let at = id; at !== undefined; at = parent.get(at)) {
      const n = name(at);
      if (!seen.has(n)) inclusive.set(n, (inclusive.get(n) ?? 0) + ms);
      seen.add(n);
    }
  });
  // Frames every sample passes through (the root, JavaScript-to-wasm glue) say nothing.
  const glue = /^\(|shim$|^js-to-wasm|^runMicrotask$|^runInAsyncScope$/;
  const top = (m) =>
    [...m]
      .filter(([n]) => !glue.test(n) || n === "(idle)" || n === "(garbage collector)")
      .sort((a, b) => b[1] - a[1])
      .slice(0, Number(opt.top))
      .map(([n, ms]) => `  ${ms.toFixed(1).padStart(8)} ms ${((100 * ms) / total).toFixed(1).padStart(5)}%  ${n.slice(0, 150)}`)
      .join("\n");
  console.log(`  profile: ${file} (${total.toFixed(0)} ms sampled)\n  inclusive:\n${top(inclusive)}\n  self:\n${top(self)}`);
}

const pkg = await import(join(pkgDir, "onnx_generate.js"));
const wasmFile = pkg.wasmFile ? pkg.wasmFile() : "onnx_generate_bg.wasm";
memory = await phase(`init (${wasmFile})`, false, async () =>
  pkg.initSync({ module: await readFile(join(pkgDir, wasmFile)) }).memory,
);
const optional = (name) => (existsSync(join(dir, name)) ? readFile(join(dir, name)) : undefined);
const files = async () => ({
  model: await openAsBlob(join(dir, onnx)),
  external_data: await optional(`${onnx}.data`),
  config: await readFile(join(dir, "config.json")),
  generation_config: await optional("generation_config.json"),
  tokenizer: await readFile(join(dir, "tokenizer.json")),
  tokenizer_config: await optional("tokenizer_config.json"),
  chat_template: await optional("chat_template.jinja"),
});
let model;
for (let i = 0; i < Number(opt.loads); i++) {
  if (model) model.free();
  model = await phase(`load ${i + 1} (${onnx})`, i === 0 && session, async () => pkg.Model.load(await files()));
}
// SmolLM2's chat prompt when the model has a template, else plain text.
const messages = [{ role: "user", content: "What is the capital of France?" }];
let input = messages;
try {
  model.applyChatTemplate(messages, true);
} catch {
  input = "The capital of France is";
}
// Tokenization set up outside the prompts, as the benchmark does.
model.encode(typeof input === "string" ? input : model.applyChatTemplate(input, true), false);
const tokens = Number(opt.tokens);
for (let p = 0; p < Number(opt.prompts); p++) {
  const times = [];
  const start = performance.now();
  const result = await phase(`prompt ${p + 1}`, p + 1 === profiledPrompt && session, () =>
    model.generate(input, {
      max_new_tokens: tokens,
      min_new_tokens: tokens,
      do_sample: false,
      on_token: () => times.push(performance.now()),
    }),
  );
  const gaps = times
    .slice(1)
    .map((t, i) => t - times[i])
    .sort((a, b) => a - b);
  const median = gaps.length ? `${gaps[gaps.length >> 1].toFixed(1)} ms` : "-";
  console.log(
    `  first token ${(times[0] - start).toFixed(0)} ms, median between tokens ${median}, ` +
      `${result.token_ids.length} tokens: ${JSON.stringify(result.text.slice(0, 60))}`,
  );
}
model.free();
