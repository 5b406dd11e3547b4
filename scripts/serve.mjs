// A static server for the demo page on 127.0.0.1: `www/` at `/`, the wasm package at `/pkg/`,
// the default model (the tiny `llama` fixture) at `/models/default/`, and with `--model DIR`
// a model folder of this machine at `/models/local/` (the page opens it by default then).
//
//   node scripts/serve.mjs [--port 8080] [--model DIR] [--pkg DIR] [--exit-after SECONDS]
//
// Stops on Ctrl-C (SIGINT) or SIGTERM, or after --exit-after seconds.
import { createServer } from "node:http";
import { createReadStream, statSync } from "node:fs";
import { extname, join, normalize, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(fileURLToPath(new URL("..", import.meta.url)));

const TYPES = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8",
  ".mjs": "text/javascript; charset=utf-8",
  ".css": "text/css; charset=utf-8",
  ".json": "application/json",
  ".wasm": "application/wasm",
  ".png": "image/png",
  ".ts": "text/plain; charset=utf-8",
  ".jinja": "text/plain; charset=utf-8",
};

/**
 * Serve `mounts` ({url prefix: folder}) on 127.0.0.1:port, adding `headers` to every file
 * response (the benchmark adds COOP/COEP for wasm threads); resolves with the http server.
 */
export function serve({ port = 8080, mounts, headers = {} }) {
  // Folders resolved (no trailing separator), longest prefix first.
  const entries = Object.entries(mounts)
    .map(([prefix, dir]) => [prefix, resolve(dir)])
    .sort((a, b) => b[0].length - a[0].length);
  const server = createServer((req, res) => {
    const path = decodeURIComponent(new URL(req.url, "http://127.0.0.1").pathname);
    const mount = entries.find(([prefix]) => path.startsWith(prefix));
    if (!mount) return notFound(res);
    const [prefix, dir] = mount;
    let file = normalize(join(dir, path.slice(prefix.length)));
    if (file !== dir && !file.startsWith(dir + sep)) return notFound(res);
    let stat;
    try {
      stat = statSync(file);
      if (stat.isDirectory()) {
        file = join(file, "index.html");
        stat = statSync(file);
      }
    } catch {
      return notFound(res);
    }
    res.writeHead(200, {
      "content-type": TYPES[extname(file)] || "application/octet-stream",
      "content-length": stat.size,
      "cache-control": "no-cache",
      ...headers,
    });
    if (req.method === "HEAD") return res.end();
    createReadStream(file).pipe(res);
  });
  return new Promise((ok, fail) => {
    server.once("error", fail);
    server.listen(port, "127.0.0.1", () => ok(server));
  });
}

function notFound(res) {
  res.writeHead(404, { "content-type": "text/plain" });
  res.end("not found\n");
}

/** The standard mounts of the demo. */
export function demoMounts({ pkg = join(root, "pkg"), model } = {}) {
  const mounts = {
    "/pkg/": resolve(pkg),
    "/models/default/": join(root, "tests/fixtures/models/llama"),
    "/": join(root, "www"),
  };
  if (model) mounts["/models/local/"] = resolve(model);
  return mounts;
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const args = process.argv.slice(2);
  const opt = (name) => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? args[i + 1] : undefined;
  };
  const model = opt("model");
  const server = await serve({
    port: Number(opt("port") || 8080),
    mounts: demoMounts({ pkg: opt("pkg"), model }),
  });
  const { port } = server.address();
  const page = model ? `?model=models/local/` : "";
  console.log(`onnx-generate demo: http://127.0.0.1:${port}/${page}  (Ctrl-C stops)`);
  const stop = () => {
    server.close();
    server.closeAllConnections();
    process.exit(0);
  };
  process.on("SIGINT", stop);
  process.on("SIGTERM", stop);
  if (opt("exit-after")) setTimeout(stop, Number(opt("exit-after")) * 1000);
}
