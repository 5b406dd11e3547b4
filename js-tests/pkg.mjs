// The built package (pkg/, or $ONNX_GENERATE_PKG), initialised, for the Node tests.
import { readFile } from "node:fs/promises";

/** The repository root. */
export const root = new URL("../", import.meta.url);
/** The package folder. */
export const pkgDir = process.env.ONNX_GENERATE_PKG
  ? new URL(`file://${process.env.ONNX_GENERATE_PKG.replace(/\/?$/, "/")}`)
  : new URL("pkg/", root);
const pkg = await import(new URL("onnx_generate.js", pkgDir));
/** The wasm file the package picks for this engine (`wasmFile()`). */
export const picked = pkg.wasmFile();
// ONNX_GENERATE_WASM=relaxed: the run tests the relaxed SIMD build, named rather than picked:
// Node 20 validates relaxed SIMD behind --experimental-wasm-relaxed-simd, but its 8-bit dot
// product fails wasmFile()'s probe (none of these tests reaches that instruction). An engine
// without relaxed SIMD fails to compile it.
const wasmFile = process.env.ONNX_GENERATE_WASM === "relaxed" ? "onnx_generate_bg_relaxed.wasm" : picked;
pkg.initSync({ module: await readFile(new URL(wasmFile, pkgDir)) });

export const { Model } = pkg;
