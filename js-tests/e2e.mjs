// End-to-end test of the demo page in headless Chromium (playwright-core driving the system
// browser): load the tiny llama fixture through the page, Generate, wait for streamed tokens,
// Stop, and save a screenshot.
//   node js-tests/e2e.mjs [SCREENSHOT.png]
import assert from "node:assert/strict";
import { existsSync, mkdirSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { chromium } from "playwright-core";
import { serve, demoMounts } from "../scripts/serve.mjs";

const screenshot = resolve(process.argv[2] || "target/e2e/demo.png");
const executablePath =
  process.env.CHROMIUM ||
  ["/usr/lib/chromium/chromium", "/usr/bin/chromium"].find((p) => existsSync(p));
assert.ok(executablePath, "Chromium not found (set CHROMIUM)");

const server = await serve({ port: 0, mounts: demoMounts() });
const url = `http://127.0.0.1:${server.address().port}/`;
const browser = await chromium.launch({
  executablePath,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
const errors = [];
try {
  const page = await browser.newPage({ viewport: { width: 1000, height: 1000 } });
  page.on("pageerror", (e) => errors.push(e.message));
  // Model.fromUrl probes optional files (onnx/model.onnx, model.onnx.data, ...): their 404s are
  // expected; any other console error is not.
  page.on("console", (m) => {
    if (m.type() === "error" && !/status of 404/.test(m.text())) errors.push(m.text());
  });
  await page.goto(url);
  await page.waitForSelector("#model-status[data-ready=true]", { timeout: 60000 });

  // Load the default model (the tiny llama fixture) by URL.
  await page.click("#load-url");
  await page.waitForSelector("#model-status[data-loaded=true]", { timeout: 60000 });
  assert.equal(await page.$eval("#load-progress", (p) => p.value === p.max && p.max > 1), true);

  // A long generation, stopped once tokens have streamed in.
  await page.fill("#max_new_tokens", "1000");
  await page.click("#generate");
  await page.waitForFunction(() => Number(document.querySelector("#output").dataset.tokens) >= 20, null, {
    timeout: 60000,
  });
  await page.click("#stop");
  await page.waitForSelector("#output[data-done=true]", { timeout: 60000 });
  const reason = await page.$eval("#output", (o) => o.dataset.finishReason);
  const tokens = Number(await page.$eval("#output", (o) => o.dataset.tokens));
  const stats = await page.textContent("#stats");
  const text = await page.textContent("#output");
  assert.equal(reason, "abort", `finish reason ${reason} (stats: ${stats})`);
  assert.ok(tokens >= 20 && text.length > 0, `${tokens} tokens, text ${JSON.stringify(text)}`);
  assert.match(stats, /tokens\/s/);
  assert.equal(await page.isDisabled("#stop"), true);
  assert.equal(await page.isDisabled("#generate"), false);

  mkdirSync(dirname(screenshot), { recursive: true });
  await page.screenshot({ path: screenshot, fullPage: true });
  assert.deepEqual(errors, []);
  console.log(`e2e: ok (${tokens} tokens streamed, then stopped: ${stats}); screenshot ${screenshot}`);
} finally {
  await browser.close();
  server.closeAllConnections();
  server.close();
}
