// Side-by-side benchmark of onnx-generate (../pkg, built by scripts/build-wasm.sh) and
// transformers.js 4.x on onnxruntime-web's wasm backend, on the same ONNX files, the same chat
// prompt and exactly N greedy tokens (Whisper: the same clip, transcribed greedily), in Node and
// in headless Chromium. See bench/README.md.
//
//   npm run bench -- [--quick] [--models fp32,q4,whisper] [--env node,chromium] [--threads 1,2]
//                    [--reps N] [--tokens N] [--budget SECONDS] [--out FILE]
//                    [--parallel-threshold MACS]   (the threads build's setParallelThreshold)
//                    [--pkg DIR]   (onnx-generate's 1-thread package: pkg/ by default)
//   npm run bench -- --batch 1,4,8 [--models fp32] [--env ...] [--tokens 16]   (onnx-generate only)
//   npm run bench -- --sample [--models q4,int8] ...   (sampling: top_k 50, temperature 0.7)
import { execFileSync, spawn } from "node:child_process";
import { closeSync, existsSync, mkdtempSync, openSync, readdirSync, readFileSync, readSync, rmSync, statSync, writeFileSync } from "node:fs";
import { cpus, loadavg, tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { Worker } from "node:worker_threads";
import { gzipSync } from "node:zlib";
import { measureBandwidth } from "./lib/bandwidth.mjs";
import { MESSAGES, MODELS, TEXT_PROMPT, layOut } from "./lib/models.mjs";
import { peakOfRenderers, rendererCpuSeconds } from "./lib/procfs.mjs";
import { report, reportBatches } from "./lib/report.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const repo = resolve(here, "..");

// ---- options ---------------------------------------------------------------------------------
const argv = process.argv.slice(2);
const flag = (name) => argv.includes(`--${name}`);
const opt = (name, fallback) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 && argv[i + 1] !== undefined ? argv[i + 1] : fallback;
};
const list = (s) => String(s).split(",").map((x) => x.trim()).filter(Boolean);
const known = new Set(["sample", "quick", "models", "env", "threads", "reps", "tokens", "budget", "out", "batch", "parallel-threshold", "pkg", "help"]);
for (const a of argv) {
  if (a.startsWith("--") && !known.has(a.slice(2))) {
    console.error(`bench: unknown option ${a} (known: ${[...known].map((k) => "--" + k).join(" ")})`);
    process.exit(2);
  }
}
if (flag("help")) {
  console.log(readFileSync(fileURLToPath(import.meta.url), "utf8").split("\n").slice(0, 8).join("\n"));
  process.exit(0);
}
const quick = flag("quick");
// The default models: text models and Whisper (--batch batches prompts: text models only).
const textModels = quick ? "fp32,q4" : "fp32,q4,fp16,int8,genai_int4";
const defaultModels = flag("batch") ? textModels : `${textModels},whisper`;
const options = {
  models: list(opt("models", defaultModels)),
  envs: list(opt("env", "node,chromium")),
  threads: list(opt("threads", quick ? "1" : "1,2")).map(Number),
  reps: Number(opt("reps", quick ? 1 : 2)),
  tokens: Number(opt("tokens", flag("batch") ? 16 : 64)),
  budgetMs: Number(opt("budget", quick ? 30 : 240)) * 1000,
  out: opt("out", null),
  batch: flag("batch") ? list(opt("batch", "1,4,8")).map(Number) : [],
  // The threads build's setParallelThreshold (multiply-accumulates), when given.
  parallelThreshold: opt("parallel-threshold", null) === null ? null : Number(opt("parallel-threshold")),
  // The folder of the 1-thread package, in the repository (another build of the package).
  pkg: opt("pkg", "pkg").replace(/\/+$/, ""),
  // Sampled tokens instead of greedy ones (text models).
  sample: flag("sample"),
};
for (const e of options.envs) {
  if (!["node", "chromium"].includes(e)) throw new Error(`--env: "${e}" is not node or chromium`);
}
for (const t of options.threads) {
  if (!(t >= 1 && Number.isInteger(t))) throw new Error(`--threads: "${t}" is not a thread count`);
}
if (options.parallelThreshold !== null && !(Number.isInteger(options.parallelThreshold) && options.parallelThreshold >= 0)) {
  throw new Error("--parallel-threshold: a count of multiply-accumulates (a whole number from 0)");
}
if (!(options.tokens >= 2)) throw new Error("--tokens must be at least 2 (decode is timed over tokens 2..N)");

const pkgWasm = join(repo, options.pkg, "onnx_generate_bg.wasm");
if (!existsSync(pkgWasm)) throw new Error(`${pkgWasm} not found: build it with scripts/build-wasm.sh`);
// onnx-generate on more than one thread: the threads build (pkg-threads/), in Chromium only
// (wasm-bindgen-rayon's workers are Web Workers, which Node lacks).
const threadsWasm = join(repo, "pkg-threads/onnx_generate_bg.wasm");
const hasThreadsPkg = existsSync(threadsWasm);
if (options.threads.some((t) => t > 1) && options.envs.includes("chromium") && !hasThreadsPkg) {
  console.log("bench: pkg-threads/ not found (scripts/build-wasm.sh --threads): onnx-generate runs on 1 thread only");
}
const tjsDir = join(here, "node_modules/@huggingface/transformers");
if (!existsSync(tjsDir)) throw new Error("transformers.js is not installed: run `npm install` in bench/ (see bench/README.md)");

// ---- models, laid out in a temporary folder of links -----------------------------------------
const realModels = resolve(process.env.ONNX_GENERATE_REAL_MODELS || join(repo, ".realmodels"));
const layoutRoot = mkdtempSync(join(tmpdir(), "onnx-generate-bench-"));
const cleanup = () => rmSync(layoutRoot, { recursive: true, force: true });
process.on("exit", cleanup);
for (const signal of ["SIGINT", "SIGTERM"]) process.on(signal, () => process.exit(130));
// A model of the default list whose files are missing is skipped with a note (genai_int4 is
// only built with GENAI=1); one named with --models must be there.
const skipped = [];
const models = options.models.flatMap((name) => {
  try {
    return [layOut(name, { repo, realModels, root: layoutRoot })];
  } catch (e) {
    if (argv.includes("--models") || !MODELS[name]) throw e;
    skipped.push(`${name}: ${e.message}`);
    return [];
  }
});
for (const s of skipped) console.log(`bench: skipping ${s}`);
if (models.length === 0) throw new Error("no model to run");
if (options.batch.length && models.some((m) => m.speech)) {
  throw new Error(`--batch: batches of rows are for text models (not ${models.filter((m) => m.speech).map((m) => m.name).join(", ")})`);
}

// ---- the machine -----------------------------------------------------------------------------
const machine = {
  date: new Date().toISOString().replace("T", " ").slice(0, 16) + " UTC",
  cores: cpus().length,
  cpu: cpus()[0]?.model ?? "unknown",
  loadStart: loadavg(),
  node: process.version,
  tjs: JSON.parse(readFileSync(join(tjsDir, "package.json"), "utf8")).version,
  ort: JSON.parse(readFileSync(join(here, "node_modules/onnxruntime-web/package.json"), "utf8")).version,
  commit: gitCommit(),
};
function gitCommit() {
  try {
    const c = execFileSync("git", ["rev-parse", "--short", "HEAD"], { cwd: repo, encoding: "utf8" }).trim();
    const dirty = execFileSync("git", ["status", "--porcelain", "--untracked-files=no"], { cwd: repo, encoding: "utf8" }).trim();
    return dirty ? `${c} (modified)` : c;
  } catch {
    return "unknown";
  }
}

// ---- the runs --------------------------------------------------------------------------------
const input = (model) => (model.chatTemplate ? MESSAGES : TEXT_PROMPT);
const spec = (engine, model, threads) => ({
  engine,
  threads,
  model: { name: model.name, dir: model.dir, onnx: model.onnx, ogVariant: model.ogVariant, tjsDtype: model.tjsDtype },
  modelsRoot: layoutRoot + "/",
  input: input(model),
  chatTemplate: model.chatTemplate,
  newTokens: options.tokens,
  budgetMs: options.budgetMs,
  speech: model.speech && { language: model.speech.language, encoder: model.speech.encoder },
  parallelThreshold: options.parallelThreshold,
  pkg: options.pkg,
  sample: options.sample,
});

/** onnx-generate's thread counts in `env`: 1 (pkg/), and in Chromium each larger count of
 * --threads when the threads build is there. */
function ogThreads(env) {
  const more = env === "chromium" && hasThreadsPkg ? options.threads.filter((t) => t > 1) : [];
  return [1, ...more];
}

/** The configurations of a model in `env`: onnx-generate and transformers.js on each count. */
function configs(model, env) {
  const out = ogThreads(env).map((t) => ({ engine: "onnx-generate", threads: t }));
  if (model.tjsDtype) for (const t of options.threads) out.push({ engine: "transformers.js", threads: t });
  return out;
}

function nodeRun(s) {
  return new Promise((ok) => {
    const child = spawn(process.execPath, [join(here, "lib/node-run.mjs"), JSON.stringify(s)], {
      cwd: here,
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    let err = "";
    child.stdout.on("data", (d) => (out += d));
    child.stderr.on("data", (d) => (err += d));
    const limit = options.budgetMs + 300000;
    const timer = setTimeout(() => child.kill("SIGKILL"), limit);
    child.on("close", (code, signal) => {
      clearTimeout(timer);
      const line = out.split("\n").find((l) => l.startsWith("BENCH_RESULT "));
      if (line) return ok(JSON.parse(line.slice("BENCH_RESULT ".length)));
      const why = signal ? `killed after ${limit / 1000} s` : `exit ${code}`;
      // The error's first line (an uncaught error prints the source line, then the message).
      const text = (err || out).trim().split("\n");
      const message = text.find((l) => /Error|error:/.test(l)) || text.slice(-1)[0];
      ok({ error: `${why}: ${message}` });
    });
  });
}

let chromium;
let server;
let serverUrl;
const executablePath = process.env.CHROMIUM || ["/usr/bin/chromium", "/usr/lib/chromium/chromium"].find(existsSync);
const fetched = new Map(); // URL path -> bytes, of the files pages fetched from /ort/ and /tjs/

async function startServer() {
  ({ chromium } = await import("playwright-core"));
  const { serve } = await import(join(repo, "scripts/serve.mjs"));
  server = await serve({
    port: 0,
    mounts: {
      "/pkg/": join(repo, options.pkg),
      "/pkg-threads/": join(repo, "pkg-threads"),
      "/bench/": join(here, "lib"),
      "/tjs/": join(tjsDir, "dist"),
      "/ort/": join(here, "node_modules/onnxruntime-web/dist"),
      "/models/": layoutRoot,
      "/js-tests/": join(repo, "js-tests"), // wav.mjs, the WAV reader of the tests
    },
    // Cross-origin isolation: SharedArrayBuffer and so wasm threads.
    headers: { "cross-origin-opener-policy": "same-origin", "cross-origin-embedder-policy": "require-corp" },
  });
  serverUrl = `http://127.0.0.1:${server.address().port}`;
}

async function withPage(fn) {
  if (!executablePath) throw new Error("Chromium not found (install Debian's chromium or set CHROMIUM)");
  const browser = await chromium.launch({
    executablePath,
    args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-renderer-backgrounding", "--disable-background-timer-throttling"],
  });
  machine.chromium = browser.version();
  const errors = [];
  try {
    const page = await browser.newPage();
    page.on("pageerror", (e) => errors.push(e.message));
    page.on("response", async (r) => {
      const path = new URL(r.url()).pathname;
      if (/^\/(ort|tjs)\//.test(path) && r.ok()) fetched.set(path, Number(r.headers()["content-length"] || 0));
    });
    await page.goto(`${serverUrl}/bench/page.html`);
    await page.waitForFunction(() => window.benchReady === true, null, { timeout: 60000 });
    return await fn(page);
  } catch (e) {
    throw new Error(`${e.message.split("\n")[0]}${errors.length ? ` (page errors: ${errors.join(" | ")})` : ""}`);
  } finally {
    await browser.close();
  }
}

async function chromiumRun(s) {
  const limit = options.budgetMs + 300000;
  try {
    return await withPage(async (page) => {
      const cpu0 = rendererCpuSeconds();
      const t0 = performance.now();
      let timer;
      const timeout = new Promise((_, fail) => {
        timer = setTimeout(() => fail(new Error(`no result after ${limit / 1000} s`)), limit);
      });
      try {
        const result = await Promise.race([page.evaluate((x) => window.benchRun(x), s), timeout]);
        result.peak_mb = peakOfRenderers();
        result.cpu_per_wall = (rendererCpuSeconds() - cpu0) / ((performance.now() - t0) / 1000);
        return result;
      } finally {
        clearTimeout(timer);
      }
    });
  } catch (e) {
    return { error: e.message };
  }
}

// ---- go --------------------------------------------------------------------------------------
const wabt = await (await import("wabt")).default();
const wat = readFileSync(join(here, "lib/bandwidth.wat"), "utf8");
const bandwidthWasm = wabt.parseWat("bandwidth.wat", wat, { simd: true, threads: true }).toBinary({}).buffer;
const bwThreads = [...new Set([1, ...options.threads])];
const bwMegabytes = quick ? 256 : 512;

const log = (...a) => console.log(`[${new Date().toISOString().slice(11, 19)}]`, ...a);
log(`bench: ${models.map((m) => m.name).join(", ")} x ${options.envs.join(", ")}; ${options.tokens} new tokens; ${options.reps} rep(s); load ${machine.loadStart.map((x) => x.toFixed(2)).join(" ")}`);

/** Bandwidth inside wasm in `env` on each thread count: threads -> result. */
async function measureAll(env) {
  const out = {};
  for (const t of bwThreads) {
    const r =
      env === "node"
        ? await measureBandwidth({
            wasm: bandwidthWasm,
            threads: t,
            megabytes: bwMegabytes,
            spawn: async () => new Worker(join(here, "lib/bandwidth-worker.mjs")),
          })
        : await withPage((page) =>
            page.evaluate(([w, n, mb]) => window.benchBandwidth(w, n, mb), [Array.from(bandwidthWasm), t, bwMegabytes]),
          );
    out[t] = { ...r, gbps_start: r.gbps };
    const streams = `one stream ${r.gbps_one_stream.toFixed(1)}, four side by side ${r.gbps_four_streams.toFixed(1)}`;
    log(`${env}: memory bandwidth inside wasm, ${t} thread(s): ${r.gbps.toFixed(1)} GB/s (${streams}; best of 5 passes over ${r.megabytes} MiB)`);
  }
  return out;
}

/**
 * Reads every file of a model's folder once (through its links) and returns the bytes read, so
 * that the first timed run, whichever engine it is, reads the files from the page cache as every
 * later run does instead of also paying the disk.
 */
function readAhead(dir) {
  const buffer = Buffer.allocUnsafe(8 << 20);
  let bytes = 0;
  for (const entry of readdirSync(dir)) {
    const path = join(dir, entry);
    if (statSync(path).isDirectory()) {
      bytes += readAhead(path);
      continue;
    }
    const fd = openSync(path, "r");
    try {
      for (let n; (n = readSync(fd, buffer, 0, buffer.length, null)) > 0; ) bytes += n;
    } finally {
      closeSync(fd);
    }
  }
  return bytes;
}

const bandwidth = {}; // env -> threads -> result
const runs = [];
try {
  if (options.envs.includes("chromium")) await startServer();
  for (const env of options.envs) {
    // Bandwidth before and after the runs of this env: the bound uses the better of the two.
    // (--batch reports no bound: it skips the bandwidth.)
    bandwidth[env] = options.batch.length ? {} : await measureAll(env);
    for (const model of models) {
      if (options.batch.length) {
        // Batches of rows (onnx-generate only), instead of the side-by-side comparison.
        const s = { ...spec("onnx-generate", model, 1), batch: options.batch };
        const r = env === "node" ? await nodeRun(s) : await chromiumRun(s);
        runs.push({ env, model: model.name, engine: "onnx-generate", threads: 1, ...r });
        log(`${env} ${model.name} batches: ${r.error ? `ERROR ${r.error}` : r.batches.map((b) => `${b.rows} rows ${b.decode_tps.toFixed(1)} tok/s`).join(", ")}`);
        continue;
      }
      const t0 = Date.now();
      const bytes = readAhead(model.dir);
      log(`${env} ${model.name}: files read ahead (${(bytes / 2 ** 20).toFixed(0)} MiB in ${((Date.now() - t0) / 1000).toFixed(1)} s)`);
      for (let rep = 0; rep < options.reps; rep++) {
        // A B A B: the order flips each repetition, so drift over time does not favour one.
        const order = rep % 2 === 0 ? configs(model, env) : [...configs(model, env)].reverse();
        for (const c of order) {
          const s = spec(c.engine, model, c.threads);
          const r = env === "node" ? await nodeRun(s) : await chromiumRun(s);
          runs.push({ env, model: model.name, rep, ...c, ...r });
          log(
            `${env} ${model.name} ${c.engine} ${c.threads}t: ` +
              (r.error
                ? `ERROR ${r.error}`
                : `load ${(r.load_ms / 1000).toFixed(2)} s, ` +
                  (model.speech
                    ? `transcription ${(r.transcribe_ms / 1000).toFixed(2)} s of ${r.audio_s.toFixed(2)} s (RTF ${r.rtf.toFixed(3)}), `
                    : "") +
                  `first token ${(r.ttft_ms / 1000).toFixed(2)} s` +
                  (r.again_ms ? ` (${(r.again_ms / 1000).toFixed(2)} s again)` : "") +
                  `, decode ${r.decode_tps?.toFixed(2)} tok/s, ` +
                  `peak ${r.peak_mb.toFixed(0)} MB, ${r.new_tokens} tokens: ${JSON.stringify(r.text.slice(0, 80))}`),
          );
        }
      }
    }
    const after = options.batch.length ? {} : await measureAll(env);
    for (const t of Object.keys(after)) {
      const b = bandwidth[env][t];
      b.gbps_end = after[t].gbps;
      b.gbps = Math.max(b.gbps, after[t].gbps);
    }
  }
} finally {
  if (server) {
    server.closeAllConnections();
    server.close();
  }
}
machine.loadEnd = loadavg();

// ---- sizes -----------------------------------------------------------------------------------
function size(path) {
  const bytes = readFileSync(path);
  return { raw: bytes.length, gzip: gzipSync(bytes, { level: 9 }).length };
}
const sizes = [{ engine: "onnx-generate", file: `${options.pkg}/onnx_generate_bg.wasm`, ...size(pkgWasm) }];
// The relaxed SIMD twin of pkg/'s wasm, which engines with relaxed SIMD load instead.
const relaxedWasm = join(repo, options.pkg, "onnx_generate_bg_relaxed.wasm");
if (existsSync(relaxedWasm)) {
  sizes.push({ engine: "onnx-generate", file: `${options.pkg}/onnx_generate_bg_relaxed.wasm`, alternative: true, ...size(relaxedWasm) });
}
if (hasThreadsPkg) sizes.push({ engine: "onnx-generate", file: "pkg-threads/onnx_generate_bg.wasm", alternative: true, ...size(threadsWasm) });
sizes.push({ engine: "onnx-generate", file: `${options.pkg}/onnx_generate.js + snippets`, ...sumSizes(pkgJsFiles()) });
const tjsFiles = fetched.size
  ? [...fetched.keys()].sort()
  : ["/tjs/transformers.js", "/ort/ort-wasm-simd-threaded.asyncify.mjs", "/ort/ort-wasm-simd-threaded.asyncify.wasm"];
for (const p of tjsFiles) {
  const file = p.startsWith("/tjs/") ? join(tjsDir, "dist", p.slice(5)) : join(here, "node_modules/onnxruntime-web/dist", p.slice(5));
  sizes.push({ engine: "transformers.js", file: p.slice(1) + (fetched.size ? "" : " (default; not observed)"), ...size(file) });
}
function pkgJsFiles() {
  const out = [join(repo, options.pkg, "onnx_generate.js")];
  const walk = (d) => {
    for (const e of readdirSync(d, { withFileTypes: true })) {
      if (e.isDirectory()) walk(join(d, e.name));
      else if (e.name.endsWith(".js")) out.push(join(d, e.name));
    }
  };
  if (existsSync(join(repo, options.pkg, "snippets"))) walk(join(repo, options.pkg, "snippets"));
  return out;
}
function sumSizes(files) {
  return files.map(size).reduce((a, b) => ({ raw: a.raw + b.raw, gzip: a.gzip + b.gzip }), { raw: 0, gzip: 0 });
}

// ---- report ----------------------------------------------------------------------------------
const { markdown, problems } = (options.batch.length ? reportBatches : report)({ machine, options, models, runs, bandwidth, sizes });
console.log("\n" + markdown);
if (options.out) {
  // npm run starts scripts in bench/: a relative --out is relative to where npm was called.
  const file = resolve(process.env.INIT_CWD || process.cwd(), options.out);
  writeFileSync(file, markdown + "\n");
  // The raw figures of every run, next to the table.
  writeFileSync(file.replace(/(\.md)?$/, ".json"), JSON.stringify({ machine, options, bandwidth, sizes, runs }, null, 1) + "\n");
  log(`bench: results written to ${file}`);
}
if (problems.length) {
  console.error(`bench: ${problems.length} problem(s):\n  ${problems.join("\n  ")}`);
  process.exitCode = 1;
}
