// The edge examples end to end: the Cloudflare Worker (examples/worker, under `wrangler dev`) and
// the Deno server (examples/deno), both on 127.0.0.1, answered over real HTTP with Node's fetch.
// Checks the OpenAI-style endpoints against the golden greedy tokens of the tiny llama fixture
// and against the package run here in Node (chat, n, seeds, stop strings), an abort by the client
// mid-stream (the server stops generating), and bad requests (400 with OpenAI's error body, the
// server serving afterwards).
//   node --test js-tests/edge.test.mjs      (needs pkg/ and `npm install`: deno, wrangler)
import { describe, test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { startDeno, startWorker, root } from "./edge-servers.mjs";
import { Model } from "./pkg.mjs";

const MODEL = "llama-fixture";
const golden = JSON.parse(await readFile(`${root}tests/fixtures/golden/llama.json`, "utf8"));
// greedy_p1: "hello" -> 12 greedy tokens.
const GREEDY = golden.cases.find((c) => c.id === "greedy_p1");
const PROMPT = GREEDY.prompts[0].text;
const MAX = GREEDY.generation_kwargs.max_new_tokens;
const EXPECTED = GREEDY.expected[0][0];
const ids = (tokens) => tokens.map((t) => Number(t.replace(/^token_id:/, "")));

// The same package, in Node: the reference for requests the golden file has no case for.
const fixture = (f) => readFile(`${root}tests/fixtures/models/llama/${f}`);
const local = await Model.load({
  model: await fixture("model.onnx"),
  config: await fixture("config.json"),
  generation_config: await fixture("generation_config.json"),
  tokenizer: await fixture("tokenizer.json"),
  chat_template: await readFile(`${root}tests/fixtures/chat/smollm2.jinja`),
});

async function post(base, path, body) {
  const r = await fetch(`${base}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: typeof body === "string" ? body : JSON.stringify(body),
  });
  const text = await r.text();
  return { status: r.status, type: r.headers.get("content-type"), text };
}

async function postJson(base, path, body) {
  const r = await post(base, path, body);
  assert.equal(r.status, 200, r.text);
  return JSON.parse(r.text);
}

/** The `data:` payloads of a server-sent-events body; asserts it ends with [DONE]. */
function events(r) {
  assert.equal(r.status, 200, r.text);
  assert.match(r.type, /^text\/event-stream/);
  const data = r.text
    .split("\n\n")
    .filter((b) => b.trim())
    .map((b) => {
      assert.match(b, /^data: /, `not an SSE data event: ${b}`);
      return b.slice(6);
    });
  assert.equal(data.at(-1), "[DONE]");
  return data.slice(0, -1).map((d) => JSON.parse(d));
}

/** Per choice of a streamed completion: text, token ids (from the log-probs) and finish reason. */
function collect(chunks, chat) {
  const out = {};
  for (const c of chunks) {
    for (const ch of c.choices) {
      const o = (out[ch.index] ??= { text: "", ids: [], finish: null, chunks: 0 });
      o.chunks++;
      o.text += chat ? (ch.delta.content ?? "") : ch.text;
      if (ch.logprobs) o.ids.push(...ids(chat ? ch.logprobs.content.map((t) => t.token) : ch.logprobs.tokens));
      if (ch.finish_reason) o.finish = ch.finish_reason;
    }
  }
  return Object.keys(out).sort((a, b) => a - b).map((k) => out[k]);
}

const stats = async (base) => (await fetch(`${base}/debug/stats`)).json();

function assertError(r, { param, code }) {
  assert.equal(r.status, 400, r.text);
  const body = JSON.parse(r.text);
  assert.equal(typeof body.error.message, "string");
  assert.ok(body.error.message.length > 0);
  assert.equal(body.error.type, "invalid_request_error");
  assert.equal(body.error.param, param);
  assert.equal(body.error.code, code);
  return body.error.message;
}

const GREEDY_BODY = { model: MODEL, prompt: PROMPT, max_tokens: MAX, temperature: 0, logprobs: 2, return_tokens_as_token_ids: true };

// EDGE_SERVERS=deno or =worker runs one of the two (the CI run checks that both ran).
const servers = [["deno", "Deno server", startDeno], ["worker", "Cloudflare Worker (wrangler dev)", startWorker]].filter(
  ([key]) => !process.env.EDGE_SERVERS || process.env.EDGE_SERVERS.split(",").includes(key),
);
for (const [, name, startServer] of servers) {
  describe(name, () => {
    let server;
    let base;
    before(async () => {
      server = await startServer();
      base = server.url;
    });
    after(async () => {
      if (server) await server.stop();
    });

    test("listens on 127.0.0.1 and lists its model", async () => {
      assert.match(base, /^http:\/\/127\.0\.0\.1:\d+$/);
      const r = await (await fetch(`${base}/v1/models`)).json();
      assert.deepEqual(r.data.map((m) => m.id), [MODEL]);
    });

    test("a non-streamed completion equals the golden greedy tokens", async () => {
      const r = await postJson(base, "/v1/completions", GREEDY_BODY);
      assert.equal(r.object, "text_completion");
      assert.equal(r.model, MODEL);
      assert.equal(r.choices.length, 1);
      const [c] = r.choices;
      assert.deepEqual(ids(c.logprobs.tokens), EXPECTED.new_token_ids);
      assert.equal(c.text, EXPECTED.text);
      assert.equal(c.finish_reason, "length");
      assert.equal(c.logprobs.token_logprobs.length, MAX);
      assert.ok(c.logprobs.token_logprobs.every((lp) => lp <= 0));
      // The greedy token is the most likely one: first among the top log-probs.
      c.logprobs.top_logprobs.forEach((top, i) => {
        assert.equal(Object.keys(top).length, 2);
        assert.equal(Math.max(...Object.values(top)), c.logprobs.token_logprobs[i]);
      });
      assert.deepEqual(r.usage, { prompt_tokens: GREEDY.prompts[0].ids.length, completion_tokens: MAX, total_tokens: GREEDY.prompts[0].ids.length + MAX });
    });

    test("a streamed completion equals the golden greedy tokens, one chunk per token, then [DONE]", async () => {
      const chunks = events(await post(base, "/v1/completions", { ...GREEDY_BODY, stream: true, stream_options: { include_usage: true } }));
      const usage = chunks.pop();
      assert.deepEqual(usage.choices, []);
      assert.equal(usage.usage.completion_tokens, MAX);
      const [c] = collect(chunks, false);
      assert.deepEqual(c.ids, EXPECTED.new_token_ids);
      assert.equal(c.text, EXPECTED.text);
      assert.equal(c.finish, "length");
      assert.equal(c.chunks, MAX);
      assert.ok(chunks.every((ch) => ch.object === "text_completion" && ch.id === chunks[0].id));
    });

    test("chat completions, streamed and not, equal the package's greedy run of the template", async () => {
      const messages = [{ role: "user", content: "Say hello." }];
      const prompt = local.encode(local.applyChatTemplate(messages, true), false);
      const expected = await local.generate(Array.from(prompt), { max_new_tokens: 10 });
      const body = { model: MODEL, messages, max_tokens: 10, temperature: 0, logprobs: true, top_logprobs: 3, return_tokens_as_token_ids: true };
      const r = await postJson(base, "/v1/chat/completions", body);
      assert.equal(r.object, "chat.completion");
      assert.equal(r.choices[0].message.role, "assistant");
      assert.equal(r.choices[0].message.content, expected.text);
      assert.deepEqual(ids(r.choices[0].logprobs.content.map((t) => t.token)), expected.token_ids);
      assert.ok(r.choices[0].logprobs.content.every((t) => t.top_logprobs.length === 3));
      assert.equal(r.usage.prompt_tokens, prompt.length);
      const chunks = events(await post(base, "/v1/chat/completions", { ...body, stream: true }));
      assert.deepEqual(chunks[0].choices[0].delta, { role: "assistant", content: "" });
      assert.ok(chunks.every((c) => c.object === "chat.completion.chunk"));
      const [c] = collect(chunks, true);
      assert.equal(c.text, expected.text);
      assert.deepEqual(c.ids, expected.token_ids);
      assert.equal(c.finish, r.choices[0].finish_reason);
    });

    test("n choices are rows of a batch; a seed makes sampling repeatable", async () => {
      const body = { model: MODEL, prompt: PROMPT, max_tokens: 8, temperature: 0.9, top_p: 0.95, seed: 7, n: 3 };
      const a = await postJson(base, "/v1/completions", body);
      const b = await postJson(base, "/v1/completions", body);
      assert.deepEqual(a.choices.map((c) => c.index), [0, 1, 2]);
      assert.deepEqual(a.choices, b.choices);
      // Row r samples with seed + r, as the package does with the same options.
      const rows = Array.from({ length: 3 }, () => GREEDY.prompts[0].ids);
      const expected = await local.generate(rows, { max_new_tokens: 8, do_sample: true, temperature: 0.9, top_p: 0.95, top_k: 0, seed: 7 });
      assert.deepEqual(a.choices.map((c) => c.text), expected.sequences.map((p) => p[0].text));
      const streamed = collect(events(await post(base, "/v1/completions", { ...body, stream: true })), false);
      assert.deepEqual(streamed.map((c) => c.text), a.choices.map((c) => c.text));
    });

    test("a stop string ends the text before it, streamed and not", async () => {
      const stop = EXPECTED.text.slice(5, 8); // " se" inside the golden text
      const cut = EXPECTED.text.slice(0, EXPECTED.text.indexOf(stop));
      const body = { model: MODEL, prompt: PROMPT, max_tokens: MAX, temperature: 0, stop: [stop, "zzzz"] };
      const r = await postJson(base, "/v1/completions", body);
      assert.equal(r.choices[0].text, cut);
      assert.equal(r.choices[0].finish_reason, "stop");
      const [c] = collect(events(await post(base, "/v1/completions", { ...body, stream: true })), false);
      assert.equal(c.text, cut);
      assert.equal(c.finish, "stop");
    });

    test("a client that aborts mid-stream stops the generation", async () => {
      const max = 240;
      // Under wrangler dev a client's disconnect does not always reach the Worker: in about one
      // try in four (measured on 2 cores) neither request.signal nor the body's cancel() fires,
      // and the generation runs to its end. Such a try shows nothing either way, so up to ten
      // are made (one is about a second).
      let s;
      let before;
      for (let attempt = 0; attempt < 10; attempt++) {
        before = await stats(base);
        const controller = new AbortController();
        const r = await fetch(`${base}/v1/completions`, {
          method: "POST",
          body: JSON.stringify({ model: MODEL, prompt: PROMPT, max_tokens: max, temperature: 0, n: 8, stream: true }),
          signal: controller.signal,
        });
        assert.equal(r.status, 200);
        const reader = r.body.getReader();
        const { value } = await reader.read();
        assert.match(new TextDecoder().decode(value), /^data: /);
        controller.abort();
        // The server notices, and the generation ends with far fewer than n * max tokens.
        const end = Date.now() + 20_000;
        do {
          await new Promise((res) => setTimeout(res, 50));
          s = await stats(base);
        } while ((s.active > 0 || (s.aborted === before.aborted && s.completed === before.completed)) && Date.now() < end);
        if (s.aborted > before.aborted) break;
      }
      assert.equal(s.active, 0, "a generation is still running");
      assert.equal(s.aborted, before.aborted + 1, `the generation was not aborted: ${JSON.stringify(s)}`);
      assert.ok(s.last_aborted_tokens < 8 * max, `aborted after ${s.last_aborted_tokens} tokens`);
      // And the server answers the next request correctly.
      const next = await postJson(base, "/v1/completions", GREEDY_BODY);
      assert.deepEqual(ids(next.choices[0].logprobs.tokens), EXPECTED.new_token_ids);
    });

    test("bad requests are 400 with OpenAI's error body, and the server keeps serving", async () => {
      assertError(await post(base, "/v1/completions", "{not json"), { param: null, code: "invalid_json" });
      assertError(await post(base, "/v1/completions", { ...GREEDY_BODY, model: "gpt-4" }), { param: "model", code: "model_not_found" });
      assertError(await post(base, "/v1/completions", { ...GREEDY_BODY, temperature: -1 }), { param: "temperature", code: "invalid_value" });
      assertError(await post(base, "/v1/chat/completions", { model: MODEL, messages: [], stream: true }), { param: "messages", code: "invalid_value" });
      assertError(await post(base, "/v1/completions", { ...GREEDY_BODY, max_tokens: 0 }), { param: "max_tokens", code: "invalid_value" });
      assertError(await post(base, "/v1/completions", { ...GREEDY_BODY, best_of_all: 2 }), { param: "best_of_all", code: "unknown_parameter" });
      // Refused by the engine (a token id outside the vocabulary), streamed or not.
      for (const stream of [false, true]) {
        const message = assertError(await post(base, "/v1/completions", { ...GREEDY_BODY, prompt: [1, 99999], stream }), { param: null, code: "invalid_value" });
        assert.match(message, /99999/);
      }
      const r = await postJson(base, "/v1/completions", GREEDY_BODY);
      assert.deepEqual(ids(r.choices[0].logprobs.tokens), EXPECTED.new_token_ids);
      const s = await stats(base);
      assert.equal(s.active, 0);
    });
  });
}
