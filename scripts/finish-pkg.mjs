// After `wasm-pack build --target web`: make pkg/package.json usable from Node as well as from
// bundlers and browsers (a `main` entry, the snippets folder in `files`), and check that the
// TypeScript declarations are the documented ones.
import { readFileSync, writeFileSync, existsSync } from "node:fs";

const path = new URL("../pkg/package.json", import.meta.url);
const pkg = JSON.parse(readFileSync(path, "utf8"));
pkg.main = pkg.main || pkg.module || "onnx_generate.js";
pkg.files = [...new Set([...(pkg.files || []), "snippets", "README.md"])];
pkg.keywords = [...new Set([...(pkg.keywords || []), "onnx", "llm", "wasm", "transformers", "generate"])];
writeFileSync(path, JSON.stringify(pkg, null, 2) + "\n");

const dts = readFileSync(new URL("../pkg/onnx_generate.d.ts", import.meta.url), "utf8");
for (const name of ["class Model", "interface GenerateOptions", "interface TokenEvent", "interface GenerateResult"]) {
  if (!dts.includes(name)) throw new Error(`pkg/onnx_generate.d.ts lacks ${name}`);
}
if (!existsSync(new URL("../pkg/snippets", import.meta.url))) throw new Error("pkg/snippets is missing");
