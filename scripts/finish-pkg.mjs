// After the wasm build: make the package's package.json (pkg/, or the folder given as the first
// argument, such as pkg-threads/) usable from Node as well as from bundlers and
// browsers (a `main` entry, the snippets folder in `files`), write it from Cargo.toml when
// wasm-pack did not, and check that the TypeScript declarations are the documented ones.
import { copyFileSync, existsSync, readFileSync, readdirSync, writeFileSync } from "node:fs";

const out = (process.argv[2] || "pkg").replace(/\/+$/, "");
const at = (p) => new URL(`../${p}`, import.meta.url);
const inPkg = (p) => at(`${out}/${p}`);
const cargo = readFileSync(at("Cargo.toml"), "utf8");
const field = (name) => (cargo.match(new RegExp(`^${name} = "([^"]*)"`, "m")) || [])[1];
const pkg = existsSync(inPkg("package.json"))
  ? JSON.parse(readFileSync(inPkg("package.json"), "utf8"))
  : {
      name: field("name"),
      version: field("version"),
      description: field("description"),
      license: field("license"),
      type: "module",
      module: "onnx_generate.js",
      types: "onnx_generate.d.ts",
      sideEffects: ["./snippets/*"],
    };
pkg.type = "module";
pkg.main = pkg.main || pkg.module || "onnx_generate.js";
pkg.types = pkg.types || "onnx_generate.d.ts";
const shipped = readdirSync(inPkg("")).filter((f) => /^onnx_generate/.test(f));
pkg.files = [...new Set([...(pkg.files || []), ...shipped, "snippets", "README.md"])];
pkg.keywords = [...new Set([...(pkg.keywords || []), "onnx", "llm", "wasm", "transformers", "generate"])];
writeFileSync(inPkg("package.json"), JSON.stringify(pkg, null, 2) + "\n");
if (!existsSync(inPkg("README.md"))) copyFileSync(at("README.md"), inPkg("README.md"));

const dts = readFileSync(inPkg("onnx_generate.d.ts"), "utf8");
for (const name of ["class Model", "interface GenerateOptions", "interface TokenEvent", "interface GenerateResult"]) {
  if (!dts.includes(name)) throw new Error(`${out}/onnx_generate.d.ts lacks ${name}`);
}
if (!existsSync(inPkg("snippets"))) throw new Error(`${out}/snippets is missing`);
