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
// folder (pkg/onnx_generate_bg_relaxed.wasm), that one where the engine validates relaxed SIMD
// and computes a probe of its instructions right, else the plain one. `wasmFile()` tells callers
// that read the bytes themselves (initSync in Node, Deno, a Worker's bundled module) which file
// to read.
const glue = readFileSync(inPkg("onnx_generate.js"), "utf8");
const relaxed = existsSync(inPkg("onnx_generate_bg_relaxed.wasm"));
const defaultUrl = "new URL('onnx_generate_bg.wasm', import.meta.url)";
const picked = "new URL(wasmFile(), import.meta.url)";
if (!glue.includes("export function wasmFile()")) {
  if (!glue.includes(defaultUrl)) throw new Error(`${out}/onnx_generate.js lacks ${defaultUrl}`);
  const helper = `
/**
 * A module of one function, exported as \`f\`: 1 where \`i32x4.relaxed_dot_i8x16_i7x16_add_s\` and
 * \`f32x4.relaxed_madd\` of constants give their exact values, else 0 (Node 20's relaxed SIMD,
 * behind \`--experimental-wasm-relaxed-simd\`, returns twice the dot product and drops the sum
 * it adds to).
 */
const RELAXED_SIMD_PROBE = new Uint8Array([${relaxedSimdProbe().join(", ")}]);

/**
 * The package's wasm file for this engine: onnx_generate_bg_relaxed.wasm (the f32 kernels with
 * relaxed SIMD's multiply-add) where the engine validates relaxed SIMD, computes the probe right
 * and the package has that file, onnx_generate_bg.wasm otherwise. init() without arguments loads
 * it.
 * @returns {string}
 */
export function wasmFile() {
    return ${relaxed} && relaxedSimdWorks() ? 'onnx_generate_bg_relaxed.wasm' : 'onnx_generate_bg.wasm';
}

/** The probe's answer, found at the first call: the engine does not change. */
let relaxedSimd;

function relaxedSimdWorks() {
    relaxedSimd ??= (() => {
        if (!WebAssembly.validate(RELAXED_SIMD_PROBE)) return false;
        try {
            return new WebAssembly.Instance(new WebAssembly.Module(RELAXED_SIMD_PROBE)).exports.f() === 1;
        } catch {
            // An engine that compiles no wasm at run time (Cloudflare's Workers): validation is all there is.
            return true;
        }
    })();
    return relaxedSimd;
}
`;
  writeFileSync(inPkg("onnx_generate.js"), glue.replace(defaultUrl, picked) + helper);
  const declaration = `
/**
 * The package's wasm file for this engine: onnx_generate_bg_relaxed.wasm where the engine has
 * relaxed SIMD and computes a probe of it right (and the package has that build),
 * onnx_generate_bg.wasm otherwise. The default init() loads it; pass it to initSync when reading
 * the bytes yourself.
 */
export function wasmFile(): string;
`;
  writeFileSync(inPkg("onnx_generate.d.ts"), readFileSync(inPkg("onnx_generate.d.ts"), "utf8") + declaration);
}

/**
 * The bytes of `RELAXED_SIMD_PROBE`: `f() -> i32` is 1 where `i32x4.relaxed_dot_i8x16_i7x16_add_s`
 * (second operand within 0..127, no pair sum past i16) and `f32x4.relaxed_madd` (exact whether
 * fused or not) of constants equal their exact values.
 */
function relaxedSimdProbe() {
  const v128 = (bytes) => [0xfd, 0x0c, ...bytes];
  const i8 = (xs) => xs.map((x) => x & 0xff);
  const i32 = (xs) => [...new Uint8Array(new Int32Array(xs).buffer)];
  const f32 = (x) => [...new Uint8Array(new Float32Array([x, x, x, x]).buffer)];
  const a = [1, 2, 3, 4, 5, 6, 7, 8, -1, -2, -3, -4, 127, -128, 0, 0];
  const b = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 127, 127, 0, 0];
  const sums = [1000, 2000, 3000, 4000];
  const want = sums.map((s, l) => s + [0, 1, 2, 3].reduce((t, i) => t + a[4 * l + i] * b[4 * l + i], 0));
  const allTrue = [0xfd, 0xa3, 0x01]; // i32x4.all_true
  const body = [
    0, // no locals
    ...v128(i8(a)), ...v128(i8(b)), ...v128(i32(sums)),
    0xfd, 0x93, 0x02, // i32x4.relaxed_dot_i8x16_i7x16_add_s
    ...v128(i32(want)), 0xfd, 0x37, ...allTrue, // i32x4.eq
    ...v128(f32(2)), ...v128(f32(3)), ...v128(f32(1)),
    0xfd, 0x85, 0x02, // f32x4.relaxed_madd
    ...v128(f32(7)), 0xfd, 0x41, ...allTrue, // f32x4.eq
    0x71, // i32.and
    0x0b,
  ];
  const leb = (n) => (n < 0x80 ? [n] : [(n & 0x7f) | 0x80, ...leb(n >> 7)]);
  const code = [1, ...leb(body.length), ...body];
  return [
    0, 0x61, 0x73, 0x6d, 1, 0, 0, 0,
    1, 5, 1, 0x60, 0, 1, 0x7f, // type: () -> i32
    3, 2, 1, 0, // function 0 of that type
    7, 5, 1, 1, 0x66, 0, 0, // export "f"
    10, ...leb(code.length), ...code,
  ];
}
