// The threads build (pkg-threads/, scripts/build-wasm.sh --threads) in headless Chromium: a
// cross-origin isolated page loads it, starts two workers with initThreadPool(2), makes every
// matmul split across the threads (setParallelThreshold(0): the tiny fixture's products are
// below the default threshold), and generates transformers' golden greedy ids of the tiny
// llama fixture, for a prompt (several rows) and then token by token (one row), with the wasm
// that init() picks (the relaxed SIMD build: Chromium has relaxed SIMD). Then, in a new page,
// the same without initThreadPool (rayon's pool is then the page's thread alone) on the plain
// simd128 wasm.
//   node js-tests/threads.mjs
import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";
import { serve } from "../scripts/serve.mjs";

const at = (p) => fileURLToPath(new URL(`../${p}`, import.meta.url));
assert.ok(existsSync(at("pkg-threads/onnx_generate_bg.wasm")), "pkg-threads/ is missing: scripts/build-wasm.sh --threads");
const executablePath =
  process.env.CHROMIUM || ["/usr/lib/chromium/chromium", "/usr/bin/chromium"].find((p) => existsSync(p));
assert.ok(executablePath, "Chromium not found (set CHROMIUM)");

// The golden ids of tests/fixtures/golden/llama.json (case greedy_p1), as in js-tests/api.test.mjs.
const HELLO = [1, 355, 459, 316];
const GOLDEN = [411, 403, 197, 128, 502, 495, 348, 1, 89, 233, 171, 297];

const isolation = { "cross-origin-opener-policy": "same-origin", "cross-origin-embedder-policy": "require-corp" };
const server = await serve({
  port: 0,
  mounts: { "/pkg-threads/": at("pkg-threads"), "/models/llama/": at("tests/fixtures/models/llama") },
  headers: isolation,
});
const origin = `http://127.0.0.1:${server.address().port}`;
const browser = await chromium.launch({
  executablePath,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
const errors = [];
try {
  const page = await browser.newPage();
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("console", (m) => {
    if (m.type() === "error" && !/status of 404/.test(m.text())) errors.push(m.text());
  });
  // An empty page of the same origin, with the isolation headers.
  await page.route(`${origin}/`, (route) =>
    route.fulfill({ status: 200, headers: { "content-type": "text/html", ...isolation }, body: "<!doctype html><title>threads</title>" }),
  );
  await page.goto(`${origin}/`);
  const t0 = Date.now();
  const run = async (workers, file) => page.evaluate(
    async ({ prompt, max_new_tokens, workers, file }) => {
      const pkg = await import("/pkg-threads/onnx_generate.js");
      await pkg.default(file ? { module_or_path: `/pkg-threads/${file}` } : undefined);
      if (workers) await pkg.initThreadPool(workers);
      pkg.setParallelThreshold(0);
      let badThreshold = null;
      try {
        pkg.setParallelThreshold(-1);
      } catch (e) {
        badThreshold = e.message;
      }
      const model = await pkg.Model.fromUrl("/models/llama/");
      const r = await model.generate(prompt, { max_new_tokens });
      const streamed = [];
      for await (const e of model.stream(prompt, { max_new_tokens })) streamed.push(e.token_id);
      return { isolated: self.crossOriginIsolated, ids: r.token_ids, streamed, badThreshold, picked: pkg.wasmFile() };
    },
    { prompt: HELLO, max_new_tokens: GOLDEN.length, workers, file },
  );
  const got = await run(2);
  assert.equal(got.picked, "onnx_generate_bg_relaxed.wasm", "init() did not pick the relaxed SIMD build");
  assert.equal(got.isolated, true, "the page is not cross-origin isolated");
  assert.deepEqual(got.ids, GOLDEN);
  assert.deepEqual(got.streamed, GOLDEN);
  assert.match(got.badThreshold ?? "", /setParallelThreshold: -1/);
  console.log(`threads: initThreadPool(2), every matmul split, ${got.picked}: golden ids in Chromium (${Date.now() - t0} ms)`);
  // A fresh page (a fresh module and pool), without initThreadPool.
  await page.reload();
  const alone = await run(0, "onnx_generate_bg.wasm");
  assert.deepEqual(alone.ids, GOLDEN);
  assert.deepEqual(alone.streamed, GOLDEN);
  assert.deepEqual(errors, []);
  console.log("threads: without initThreadPool, onnx_generate_bg.wasm: golden ids");
} finally {
  await browser.close();
  server.closeAllConnections();
  server.close();
}
