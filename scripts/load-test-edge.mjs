// A bounded localhost load test of the edge examples: N requests from C concurrent clients to
// the Worker (wrangler dev) and to the Deno server, each the golden greedy completion of the
// tiny llama fixture (half streamed, half not). Prints throughput and latency percentiles, and
// fails unless every response was complete and correct.
//
//   node scripts/load-test-edge.mjs [--requests 200] [--concurrency 8] [--servers deno,worker]
//
// Needs pkg/ (scripts/build-wasm.sh) and the npm dev dependencies (deno, wrangler).
import { readFile } from "node:fs/promises";
import { startDeno, startWorker, root } from "../js-tests/edge-servers.mjs";

const opt = { requests: 200, concurrency: 8, servers: "deno,worker" };
for (let i = 2; i < process.argv.length; i += 2) {
  const key = process.argv[i].replace(/^--/, "");
  if (!(key in opt) || process.argv[i + 1] === undefined) {
    console.error("usage: node scripts/load-test-edge.mjs [--requests N] [--concurrency C] [--servers deno,worker]");
    process.exit(2);
  }
  opt[key] = typeof opt[key] === "number" ? Number(process.argv[i + 1]) : process.argv[i + 1];
}

const golden = JSON.parse(await readFile(`${root}tests/fixtures/golden/llama.json`, "utf8"));
const greedy = golden.cases.find((c) => c.id === "greedy_p1");
const expected = greedy.expected[0][0];
const body = {
  model: "llama-fixture",
  prompt: greedy.prompts[0].text,
  max_tokens: greedy.generation_kwargs.max_new_tokens,
  temperature: 0,
  logprobs: 0,
  return_tokens_as_token_ids: true,
};
const idsOf = (tokens) => tokens.map((t) => Number(t.slice("token_id:".length)));
const same = (a, b) => a.length === b.length && a.every((x, i) => x === b[i]);

/** One request; resolves with {ms, firstMs, ok, why}. */
async function one(base, stream) {
  const t0 = performance.now();
  const r = await fetch(`${base}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ ...body, stream }),
  });
  let text = "";
  let ids = [];
  let finish = null;
  let firstMs = null;
  if (!stream) {
    const j = await r.json();
    firstMs = performance.now() - t0;
    const c = j.choices?.[0];
    text = c?.text;
    ids = idsOf(c?.logprobs?.tokens ?? []);
    finish = c?.finish_reason;
  } else {
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let raw = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      firstMs ??= performance.now() - t0;
      raw += value;
    }
    const data = raw.split("\n\n").filter((b) => b.startsWith("data: ")).map((b) => b.slice(6));
    if (data.at(-1) !== "[DONE]") return { ms: performance.now() - t0, ok: false, why: "no [DONE]" };
    for (const d of data.slice(0, -1)) {
      const c = JSON.parse(d).choices[0];
      text += c.text;
      ids.push(...idsOf(c.logprobs?.tokens ?? []));
      finish = c.finish_reason ?? finish;
    }
  }
  const ms = performance.now() - t0;
  const ok = r.status === 200 && text === expected.text && same(ids, expected.new_token_ids) && finish === "length";
  return { ms, firstMs, ok, why: ok ? "" : `status ${r.status}, text ${JSON.stringify(text)}, ids ${ids}, finish ${finish}` };
}

const pct = (sorted, p) => sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)];

async function load(server) {
  const base = server.url;
  await one(base, false); // warm-up (loads the model in the Worker)
  const mem0 = (await (await fetch(`${base}/debug/stats`)).json()).wasm_memory_bytes;
  const results = [];
  let next = 0;
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: opt.concurrency }, async () => {
      while (next < opt.requests) {
        const i = next++;
        results.push({ stream: i % 2 === 0, ...(await one(base, i % 2 === 0)) });
      }
    }),
  );
  const wall = (performance.now() - t0) / 1000;
  const stats = await (await fetch(`${base}/debug/stats`)).json();
  const ms = results.map((r) => r.ms).sort((a, b) => a - b);
  const first = results.filter((r) => r.stream).map((r) => r.firstMs).sort((a, b) => a - b);
  const bad = results.filter((r) => !r.ok);
  return {
    server: server.name,
    requests: results.length,
    correct: results.length - bad.length,
    wall_s: wall.toFixed(2),
    req_per_s: (results.length / wall).toFixed(1),
    tokens_per_s: ((results.length * body.max_tokens) / wall).toFixed(0),
    p50_ms: pct(ms, 50).toFixed(1),
    p90_ms: pct(ms, 90).toFixed(1),
    p99_ms: pct(ms, 99).toFixed(1),
    stream_first_byte_p50_ms: pct(first, 50).toFixed(1),
    wasm_memory_mib: `${(mem0 / 2 ** 20).toFixed(1)} -> ${(stats.wasm_memory_bytes / 2 ** 20).toFixed(1)}`,
    firstFailure: bad[0]?.why,
  };
}

const starters = { deno: startDeno, worker: startWorker };
const rows = [];
let failed = false;
for (const name of opt.servers.split(",")) {
  if (!starters[name]) throw new Error(`unknown server ${name}; use deno, worker`);
  const server = await starters[name]();
  try {
    const row = await load(server);
    rows.push(row);
    if (row.correct !== row.requests) failed = true;
  } finally {
    await server.stop();
  }
}
console.log(`${opt.requests} requests from ${opt.concurrency} concurrent clients, each ${body.max_tokens} greedy tokens (half streamed)`);
console.table(rows.map(({ firstFailure, ...r }) => r));
for (const r of rows) if (r.firstFailure) console.error(`${r.server}: first failure: ${r.firstFailure}`);
if (failed) {
  console.error("load-test-edge: some responses were incomplete or wrong");
  process.exit(1);
}
console.log("load-test-edge: every response was complete and correct");
