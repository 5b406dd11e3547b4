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

// The wasm that init() loads by default: with scripts/build-wasm.sh's relaxed SIMD build in the
// folder (pkg/onnx_generate_bg_relaxed.wasm), that one where the engine validates relaxed SIMD,
// else the plain one. `wasmFile()` tells callers that read the bytes themselves (initSync in
// Node, Deno, a Worker's bundled module) which file to read.
const glue = readFileSync(inPkg("onnx_generate.js"), "utf8");
const relaxed = existsSync(inPkg("onnx_generate_bg_relaxed.wasm"));
const defaultUrl = "new URL('onnx_generate_bg.wasm', import.meta.url)";
const picked = "new URL(wasmFile(), import.meta.url)";
if (!glue.includes("export function wasmFile()")) {
  if (!glue.includes(defaultUrl)) throw new Error(`${out}/onnx_generate.js lacks ${defaultUrl}`);
  const helper = `
/** A module of one function that returns \`f32x4.relaxed_madd\` of three zero vectors. */
const RELAXED_SIMD_PROBE = new Uint8Array([0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0,
    10, 61, 1, 59, 0, ...[0, 1, 2].flatMap(() => [253, 12, ...new Array(16).fill(0)]), 253, 133, 2, 11]);

/**
 * The package's wasm file for this engine: onnx_generate_bg_relaxed.wasm (the f32 kernels with
 * relaxed SIMD's multiply-add) where the engine validates relaxed SIMD and the package has it,
 * onnx_generate_bg.wasm otherwise. init() without arguments loads it.
 * @returns {string}
 */
export function wasmFile() {
    const relaxed = ${relaxed} && WebAssembly.validate(RELAXED_SIMD_PROBE);
    return relaxed ? 'onnx_generate_bg_relaxed.wasm' : 'onnx_generate_bg.wasm';
}
`;
  writeFileSync(inPkg("onnx_generate.js"), glue.replace(defaultUrl, picked) + helper);
  const declaration = `
/**
 * The package's wasm file for this engine: onnx_generate_bg_relaxed.wasm where the engine has
 * relaxed SIMD (and the package has that build), onnx_generate_bg.wasm otherwise. The default
 * init() loads it; pass it to initSync when reading the bytes yourself.
 */
export function wasmFile(): string;
`;
  writeFileSync(inPkg("onnx_generate.d.ts"), readFileSync(inPkg("onnx_generate.d.ts"), "utf8") + declaration);
}
