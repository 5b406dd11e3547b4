// End-to-end test of the demo page in headless Chromium (playwright-core driving the system
// browser): load the tiny llama fixture through the page, Generate, wait for streamed tokens,
// Stop, and save a screenshot. Then, in the same page, a vision-language chat whose image is an
// ImageBitmap and one whose image is an ImageData (the tiny Qwen2-VL fixture, served by URL):
// both give transformers' golden ids.
//   node js-tests/e2e.mjs [SCREENSHOT.png]
import assert from "node:assert/strict";
import { existsSync, mkdirSync, readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";
import { serve, demoMounts } from "../scripts/serve.mjs";

const screenshot = resolve(process.argv[2] || "target/e2e/demo.png");
const executablePath =
  process.env.CHROMIUM ||
  ["/usr/lib/chromium/chromium", "/usr/bin/chromium"].find((p) => existsSync(p));
assert.ok(executablePath, "Chromium not found (set CHROMIUM)");

const vlmDir = fileURLToPath(new URL("../tests/fixtures/vlm/", import.meta.url));
const server = await serve({ port: 0, mounts: { "/vlm/": vlmDir, ...demoMounts() } });
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
  // A vision-language chat in the page: an ImageBitmap, then an ImageData, of the golden image.
  const golden = JSON.parse(readFileSync(join(vlmDir, "golden/qwen2-vl.json"), "utf8"));
  const c = golden.cases.find((c) => c.id === "greedy_1img");
  const expected = c.expected[0][0].new_token_ids;
  const image = golden.images[c.prompts[0].images[0]];
  const got = await page.evaluate(
    async ({ imageFile, max_new_tokens }) => {
      const { Model } = await import("/pkg/onnx_generate.js");
      const model = await Model.fromUrl("/vlm/models/qwen2-vl/");
      // The golden image: a uint8 HWC RGB .npy (version 1 header).
      const npy = new Uint8Array(await (await fetch(`/vlm/golden/${imageFile}`)).arrayBuffer());
      const headerLen = npy[8] | (npy[9] << 8);
      const header = new TextDecoder().decode(npy.subarray(10, 10 + headerLen));
      const [height, width] = /'shape':\s*\((\d+),\s*(\d+)/.exec(header).slice(1).map(Number);
      const rgb = npy.subarray(10 + headerLen);
      const rgba = new Uint8ClampedArray(width * height * 4);
      for (let i = 0; i < width * height; i++) {
        rgba.set(rgb.subarray(3 * i, 3 * i + 3), 4 * i);
        rgba[4 * i + 3] = 255;
      }
      const imageData = new ImageData(rgba, width, height);
      const bitmap = await createImageBitmap(imageData);
      const chat = (image) => [
        { role: "user", content: [{ type: "image", image }, { type: "text", text: "Describe this image." }] },
      ];
      const fromBitmap = await model.generate(chat(bitmap), { max_new_tokens });
      const fromImageData = await model.generate(chat(imageData), { max_new_tokens });
      model.free();
      return [fromBitmap.token_ids, fromImageData.token_ids];
    },
    { imageFile: image.file, max_new_tokens: c.generation_kwargs.max_new_tokens },
  );
  assert.deepEqual(got, [expected, expected], "qwen2-vl chat with an ImageBitmap / ImageData in Chromium");

  assert.deepEqual(errors, []);
  console.log(`e2e: ok (${tokens} tokens streamed, then stopped: ${stats}); screenshot ${screenshot}; vision chat with an ImageBitmap and an ImageData gave the golden ids`);
} finally {
  await browser.close();
  server.closeAllConnections();
  server.close();
}
