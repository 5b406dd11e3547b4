// The JavaScript API of the built package (pkg/) in Node: streaming with `for await`, a
// ReadableStream as a Response body, the event loop running between steps, AbortSignal,
// Model.fromUrl with progress, and errors that name the bad input.
//   node --test js-tests/
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { serve, demoMounts } from "../scripts/serve.mjs";
import { Model, picked, pkgDir, root } from "./pkg.mjs";

const fixture = (name, file) => readFile(new URL(`tests/fixtures/models/${name}/${file}`, root));
const files = async (name) => ({
  model: await fixture(name, "model.onnx"),
  config: await fixture(name, "config.json"),
  generation_config: await fixture(name, "generation_config.json"),
  tokenizer: await fixture(name, "tokenizer.json"),
});
const HELLO = [1, 355, 459, 316];
const GOLDEN = [411, 403, 197, 128, 502, 495, 348, 1, 89, 233, 171, 297];

let model;
before(async () => {
  model = await Model.load(await files("llama"));
});

test("wasmFile() picks the relaxed SIMD wasm where this Node computes relaxed SIMD right", async () => {
  const relaxed = "onnx_generate_bg_relaxed.wasm";
  const bytes = await readFile(new URL(relaxed, pkgDir)).catch(() => null);
  // Node 20 validates relaxed SIMD only behind --experimental-wasm-relaxed-simd, and there its
  // i32x4.relaxed_dot_i8x16_i7x16_add_s returns twice the dot product and drops the sum it adds
  // to: the probe fails. Node 22 and later have relaxed SIMD, right.
  const major = Number(process.versions.node.split(".")[0]);
  const right = bytes !== null && WebAssembly.validate(bytes) && major > 20;
  assert.equal(picked, right ? relaxed : "onnx_generate_bg.wasm");
});

test("generate resolves with the golden ids, text and finish reason", async () => {
  const events = [];
  const r = await model.generate(HELLO, { max_new_tokens: 12, on_token: (e) => events.push(e) });
  assert.deepEqual(r.token_ids, GOLDEN);
  assert.equal(r.finish_reason, "length");
  assert.equal(events.length, 12);
  assert.deepEqual(events.map((e) => e.token_id), GOLDEN);
  assert.deepEqual(events.map((e) => e.finished), [...Array(11).fill(false), true]);
  assert.equal(events.map((e) => e.text).join(""), r.text);
  assert.equal(r.sequences[0][0].text, r.text);
});

test("stream() is an async iterator of the same events", async () => {
  const events = [];
  for await (const e of model.stream(HELLO, { max_new_tokens: 12 })) events.push(e);
  assert.deepEqual(events.map((e) => e.token_id), GOLDEN);
  assert.equal(events.at(-1).finished, true);
  assert.equal(events.at(-1).finish_reason, "length");
});

test("breaking out of stream() stops generation and the model recovers", async () => {
  let seen = 0;
  const it = model.stream(HELLO, { max_new_tokens: 200, on_token: () => seen++ });
  for await (const e of it) {
    if (e.token_id === GOLDEN[2]) break;
  }
  const atBreak = seen;
  await new Promise((r) => setTimeout(r, 50));
  assert.ok(seen <= atBreak + 1, `generation went on after break: ${atBreak} -> ${seen}`);
  const r = await model.generate(HELLO, { max_new_tokens: 12 });
  assert.deepEqual(r.token_ids, GOLDEN);
});

test("readable() is a ReadableStream usable as a Response body", async () => {
  const r = await model.generate(HELLO, { max_new_tokens: 12 });
  const text = await new Response(model.readable(HELLO, { max_new_tokens: 12 })).text();
  assert.equal(text, r.text);
});

test("a setTimeout callback fires during a long generation", async () => {
  let tokens = 0;
  let firedAt = null;
  setTimeout(() => {
    firedAt = tokens;
  }, 0);
  const r = await model.generate(HELLO, { max_new_tokens: 200, on_token: () => tokens++ });
  assert.notEqual(firedAt, null, "the timer never fired");
  assert.ok(firedAt < r.token_ids.length, `the timer fired only after the end (${firedAt})`);
});

test("an AbortSignal resolves with finish_reason abort; the model recovers", async () => {
  const controller = new AbortController();
  const events = [];
  const r = await model.generate(HELLO, {
    max_new_tokens: 200,
    signal: controller.signal,
    on_token: (e) => {
      events.push(e);
      if (events.length === 3) controller.abort();
    },
  });
  assert.equal(r.finish_reason, "abort");
  assert.deepEqual(r.token_ids, GOLDEN.slice(0, 3));
  // Already aborted: no token.
  const r2 = await model.generate(HELLO, { signal: AbortSignal.abort() });
  assert.equal(r2.finish_reason, "abort");
  assert.deepEqual(r2.token_ids, []);
  assert.deepEqual((await model.generate(HELLO, { max_new_tokens: 12 })).token_ids, GOLDEN);
});

test("bad input rejects with an Error naming it; the model recovers", async () => {
  const cases = [
    [HELLO, { max_new_tokenz: 3 }, /unknown option `max_new_tokenz`; valid options are: .*max_new_tokens/],
    [HELLO, { max_new_tokens: -4 }, /max_new_tokens.*-4/],
    [HELLO, { top_k: "many" }, /top_k/],
    [HELLO, { on_token: 5 }, /on_token/],
    [HELLO, { signal: "stop" }, /signal/],
    [[1, 1e6], {}, /1000000/],
    [{ text: "hi" }, {}, /input must be/],
  ];
  for (const [input, options, pattern] of cases) {
    await assert.rejects(model.generate(input, options), (e) => {
      assert.ok(e instanceof Error);
      assert.match(e.message, pattern);
      return true;
    });
  }
  await assert.rejects(
    Model.load({ ...(await files("llama")), model: await fixture("llama", "tokenizer.json") }),
    /model/,
  );
  await assert.rejects(Model.load({ config: new Uint8Array(1) }), /`model` is missing/);
  await assert.rejects(Model.load({ ...(await files("llama")), tokenizers: "x" }), /unknown model file `tokenizers`/);
  assert.deepEqual((await model.generate(HELLO, { max_new_tokens: 12 })).token_ids, GOLDEN);
});

// Custom logits processors: `logits_processor`, functions (tokenIds, logits) => void | Float32Array.
test("a logits processor that bans a token equals suppress_tokens and bad_words_ids", async () => {
  const banned = GOLDEN[1];
  const ban = (ids, logits) => {
    logits[banned] = -Infinity;
  };
  const r = await model.generate(HELLO, { max_new_tokens: 12, logits_processor: [ban] });
  assert.ok(!r.token_ids.includes(banned), `${banned} in ${r.token_ids}`);
  assert.equal(r.token_ids[0], GOLDEN[0]);
  assert.notDeepEqual(r.token_ids, GOLDEN);
  const suppressed = await model.generate(HELLO, { max_new_tokens: 12, suppress_tokens: [banned] });
  const badWords = await model.generate(HELLO, { max_new_tokens: 12, bad_words_ids: [[banned]] });
  assert.deepEqual(r.token_ids, suppressed.token_ids);
  assert.deepEqual(r.token_ids, badWords.token_ids);
  // Sampling with a seed and log-probs: the same draws and log-probs as suppress_tokens.
  const sampling = { max_new_tokens: 12, do_sample: true, seed: 3, top_k: 8, output_scores: true };
  const s1 = await model.generate(HELLO, { ...sampling, logits_processor: ban });
  const s2 = await model.generate(HELLO, { ...sampling, suppress_tokens: [banned] });
  assert.deepEqual(s1.token_ids, s2.token_ids);
  assert.deepEqual(s1.logprobs, s2.logprobs);
  // stream() takes processors too.
  const streamed = [];
  for await (const e of model.stream(HELLO, { max_new_tokens: 12, logits_processor: [ban] })) streamed.push(e.token_id);
  assert.deepEqual(streamed, r.token_ids);
});

test("a logits processor sees the sequence so far and may return a new array", async () => {
  const seen = [];
  const forced = 7;
  const force = (ids, logits) => {
    assert.ok(ids instanceof Uint32Array);
    assert.ok(logits instanceof Float32Array);
    assert.equal(logits.length, model.vocabSize);
    seen.push(Array.from(ids));
    const out = new Float32Array(logits.length).fill(-Infinity);
    out[forced] = 0;
    return out;
  };
  const r = await model.generate(HELLO, { max_new_tokens: 4, logits_processor: [force] });
  assert.deepEqual(r.token_ids, [forced, forced, forced, forced]);
  assert.deepEqual(seen, [0, 1, 2, 3].map((n) => [...HELLO, ...Array(n).fill(forced)]));
});

test("logits processors run in order, after suppress_tokens and before the warpers", async () => {
  const order = [];
  const first = (ids, logits) => {
    order.push("first");
    // suppress_tokens ran before: its token is already -Infinity.
    assert.equal(logits[5], -Infinity);
    logits[GOLDEN[0]] = -Infinity;
  };
  const second = (ids, logits) => {
    order.push("second");
    assert.equal(logits[GOLDEN[0]], -Infinity);
    // top_k runs after: more than one score is still finite.
    assert.ok(logits.filter(Number.isFinite).length > 1);
  };
  const r = await model.generate(HELLO, {
    max_new_tokens: 2,
    do_sample: true,
    top_k: 1,
    seed: 1,
    suppress_tokens: [5],
    logits_processor: [first, second],
  });
  assert.deepEqual(order, ["first", "second", "first", "second"]);
  assert.notEqual(r.token_ids[0], GOLDEN[0]);
});

test("a throwing logits processor rejects with its index and cause; the model recovers", async () => {
  let calls = 0;
  const ok = () => {};
  const boom = () => {
    if (++calls === 3) throw new Error("processor broke");
  };
  await assert.rejects(
    model.generate(HELLO, { max_new_tokens: 12, logits_processor: [ok, boom] }),
    (e) => {
      assert.ok(e instanceof Error);
      assert.match(e.message, /`logits_processor` 1 threw at row 0 \(6 tokens\): processor broke/);
      assert.equal(e.cause.message, "processor broke");
      return true;
    },
  );
  assert.equal(calls, 3);
  await assert.rejects(
    model.generate(HELLO, { logits_processor: () => { throw "plain string"; } }),
    /`logits_processor` 0 threw at row 0 \(4 tokens\): plain string/,
  );
  assert.deepEqual((await model.generate(HELLO, { max_new_tokens: 12 })).token_ids, GOLDEN);
});

test("a logits processor returning the wrong length or type rejects; the model recovers", async () => {
  const cases = [
    [() => new Float32Array(10), /`logits_processor` 0 returned a Float32Array of length 10; expected length 512/],
    [() => [1, 2, 3], /`logits_processor` 0 returned a plain array; expected a Float32Array of length 512/],
    [() => new Float64Array(512), /`logits_processor` 0 returned a Float64Array/],
    [() => 3, /`logits_processor` 0 returned a number/],
  ];
  for (const [f, pattern] of cases) {
    await assert.rejects(model.generate(HELLO, { max_new_tokens: 3, logits_processor: [f] }), (e) => {
      assert.ok(e instanceof Error);
      assert.match(e.message, pattern);
      return true;
    });
  }
  await assert.rejects(model.generate(HELLO, { logits_processor: [() => {}, 5] }), /`logits_processor` 1 must be a function/);
  await assert.rejects(model.generate(HELLO, { logits_processor: {} }), /`logits_processor` must be a list of functions/);
  assert.deepEqual((await model.generate(HELLO, { max_new_tokens: 12 })).token_ids, GOLDEN);
});

test("gpt2 through the same API", async () => {
  const golden = JSON.parse(await readFile(new URL("tests/fixtures/golden/gpt2.json", root)));
  const gpt2 = await Model.load(await files("gpt2"));
  const c = golden.cases.find((c) => c.tags.includes("plain_greedy") && c.prompts.length === 1);
  const r = await gpt2.generate(c.prompts[0].ids, c.generation_kwargs);
  assert.deepEqual(r.token_ids, c.expected[0][0].new_token_ids);
  assert.equal(r.finish_reason, c.expected[0][0].finish_reason);
  gpt2.free();
});

test("Model.fromUrl reads a served folder with per-file progress", async () => {
  const server = await serve({ port: 0, mounts: demoMounts({ pkg: fileURLToPath(pkgDir) }) });
  try {
    const base = `http://127.0.0.1:${server.address().port}/models/default/`;
    const progress = [];
    const m = await Model.fromUrl(base, { on_progress: (p) => progress.push(p) });
    const files = new Set(progress.map((p) => p.file));
    for (const f of ["model", "config", "generation_config", "tokenizer", "tokenizer_config"]) {
      assert.ok(files.has(f), `no progress for ${f}`);
      const last = progress.filter((p) => p.file === f).at(-1);
      assert.equal(last.loaded, last.total);
    }
    assert.deepEqual((await m.generate("hello", { max_new_tokens: 12 })).token_ids, GOLDEN);
    await assert.rejects(Model.fromUrl(`${base}missing/`), /no ONNX model under/);
  } finally {
    server.closeAllConnections();
    server.close();
  }
});

test("Blob and Response sources are streamed into the engine and load the same model", async () => {
  const bytes = await files("llama");
  const progress = [];
  const m = await Model.load(
    {
      ...bytes,
      model: new Blob([bytes.model]),
      tokenizer: new Response(bytes.tokenizer),
      config: new Blob([bytes.config]),
    },
    { on_progress: (p) => progress.push(p) },
  );
  assert.deepEqual((await m.generate(HELLO, { max_new_tokens: 12 })).token_ids, GOLDEN);
  const model = progress.filter((p) => p.file === "model");
  const last = model.at(-1);
  assert.equal(last.loaded, bytes.model.length);
  assert.equal(last.total, bytes.model.length);
  // The Blob (652 KB) was read in more than one slice.
  assert.ok(model.some((p) => p.loaded > 0 && p.loaded < p.total), JSON.stringify(model));
  // An empty streamed file is the same error as empty bytes.
  await assert.rejects(Model.load({ ...bytes, model: new Blob([]) }), /model.onnx is empty|is empty/);
  // A body in many small chunks: a byte stream (read into one reused buffer) and a stream that
  // is not one (read chunk by chunk).
  const pieces = (type) => {
    let at = 0;
    return new ReadableStream({
      type,
      pull(c) {
        if (at >= bytes.model.length) {
          c.close();
          // A byte stream's pending read into a buffer ends when that buffer is returned.
          if (c.byobRequest) c.byobRequest.respond(0);
          return;
        }
        // A copy: a byte stream takes over the buffer it is given.
        c.enqueue(new Uint8Array(bytes.model.subarray(at, at + 1000)));
        at += 1000;
      },
    });
  };
  for (const type of ["bytes", undefined]) {
    const streamed = await Model.load({ ...bytes, model: new Response(pieces(type)) });
    assert.deepEqual((await streamed.generate(HELLO, { max_new_tokens: 12 })).token_ids, GOLDEN, `${type} stream`);
  }
  // A Content-Length beyond wasm memory (a wrong header) is not reserved: the files still load.
  const wrong = { headers: { "content-length": String(2 ** 40) } };
  const told = await Model.load({
    ...bytes,
    model: new Response(bytes.model, wrong),
    tokenizer: new Response(bytes.tokenizer, wrong),
  });
  assert.deepEqual((await told.generate(HELLO, { max_new_tokens: 12 })).token_ids, GOLDEN, "wrong Content-Length");
});
