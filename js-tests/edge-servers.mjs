// Start and stop the edge examples on 127.0.0.1 for the tests and the load test: the Cloudflare
// Worker under `wrangler dev` (workerd) and the Deno server, both with GET /debug/stats. Each
// server runs in its own process group, which `stop()` ends by its id.
import { spawn } from "node:child_process";
import { createServer } from "node:net";
import { fileURLToPath } from "node:url";

export const root = fileURLToPath(new URL("../", import.meta.url));
const bin = (name) => fileURLToPath(new URL(`node_modules/.bin/${name}`, new URL("../", import.meta.url)));

/** A port free on 127.0.0.1 now. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

/**
 * Spawn `command` in its own process group; resolve once `ready(output)` returns a URL, with
 * `{url, log(), stop()}`. Fails after `timeoutMs` or when the process exits first.
 */
function start(name, command, args, { cwd, env, ready, timeoutMs }) {
  const child = spawn(command, args, {
    cwd,
    env: { ...process.env, ...env },
    stdio: ["ignore", "pipe", "pipe"],
    detached: true,
  });
  let output = "";
  let exited = false;
  const server = {
    name,
    pid: child.pid,
    log: () => output,
    async stop() {
      if (exited) return;
      const gone = new Promise((r) => child.once("exit", r));
      try {
        process.kill(-child.pid, "SIGTERM");
      } catch {}
      const timer = setTimeout(() => {
        try {
          process.kill(-child.pid, "SIGKILL");
        } catch {}
      }, 5000);
      await gone;
      clearTimeout(timer);
      // Whatever the server started in its group (wrangler's workerd and esbuild) goes too.
      try {
        process.kill(-child.pid, "SIGKILL");
      } catch {}
    },
  };
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      server.stop();
      reject(new Error(`${name} was not ready after ${timeoutMs} ms:\n${output}`));
    }, timeoutMs);
    const onData = (d) => {
      output += d;
      const url = ready(output);
      if (url && !server.url) {
        server.url = url;
        clearTimeout(timer);
        resolve(server);
      }
    };
    child.stdout.on("data", onData);
    child.stderr.on("data", onData);
    child.once("exit", (code, signal) => {
      exited = true;
      clearTimeout(timer);
      if (!server.url) reject(new Error(`${name} exited (${code ?? signal}) before it was ready:\n${output}`));
    });
  });
}

/** Wait until GET url answers 200 (wrangler prints "Ready" before the Worker has loaded). */
async function untilServing(url, timeoutMs) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    try {
      const r = await fetch(url);
      await r.arrayBuffer();
      if (r.ok) return;
    } catch {}
    if (Date.now() > end) throw new Error(`${url} did not answer 200 within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

/** The Deno server (examples/deno/server.js) on a port Deno picks. */
export async function startDeno(extraArgs = []) {
  const server = await start(
    "deno",
    bin("deno"),
    ["run", "--allow-read", "--allow-net=127.0.0.1", "examples/deno/server.js", "--port", "0", "--debug", ...extraArgs],
    {
      cwd: root,
      env: { NO_COLOR: "1" },
      ready: (out) => (out.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//) || [])[1],
      timeoutMs: 120_000,
    },
  );
  await untilServing(`${server.url}/v1/models`, 30_000);
  return server;
}

/** The Worker (examples/worker) under `wrangler dev` on 127.0.0.1. */
export async function startWorker() {
  const port = await freePort();
  const inspector = await freePort();
  const server = await start(
    "worker",
    bin("wrangler"),
    [
      "dev", "--ip", "127.0.0.1", "--port", String(port), "--inspector-port", String(inspector),
      "--var", "DEBUG_STATS:1", "--show-interactive-dev-session=false", "--log-level", "info",
    ],
    {
      cwd: `${root}examples/worker`,
      env: { WRANGLER_SEND_METRICS: "false", CLOUDFLARE_CF_FETCH_ENABLED: "false", NO_COLOR: "1", CI: "1", FORCE_COLOR: "0" },
      ready: (out) => (/Ready on http:\/\/127\.0\.0\.1:\d+/.test(out) ? `http://127.0.0.1:${port}` : null),
      timeoutMs: 120_000,
    },
  );
  await untilServing(`${server.url}/v1/models`, 60_000);
  return server;
}
