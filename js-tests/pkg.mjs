// The built package (pkg/, or $ONNX_GENERATE_PKG), initialised, for the Node tests.
import { readFile } from "node:fs/promises";

/** The repository root. */
export const root = new URL("../", import.meta.url);
/** The package folder. */
export const pkgDir = process.env.ONNX_GENERATE_PKG
  ? new URL(`file://${process.env.ONNX_GENERATE_PKG.replace(/\/?$/, "/")}`)
  : new URL("pkg/", root);
const pkg = await import(new URL("onnx_generate.js", pkgDir));
// The wasm file the package picks for this engine.
const wasmFile = pkg.wasmFile();
// ONNX_GENERATE_WASM=relaxed: the run must test the relaxed SIMD build (Node with relaxed SIMD).
if (process.env.ONNX_GENERATE_WASM === "relaxed" && wasmFile !== "onnx_generate_bg_relaxed.wasm") {
  throw new Error(`ONNX_GENERATE_WASM=relaxed, but the package picked ${wasmFile} (no relaxed SIMD in this Node?)`);
}
pkg.initSync({ module: await readFile(new URL(wasmFile, pkgDir)) });

export const { Model } = pkg;
