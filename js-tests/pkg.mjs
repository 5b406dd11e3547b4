// The built package (pkg/, or $ONNX_GENERATE_PKG), initialised, for the Node tests.
import { readFile } from "node:fs/promises";

/** The repository root. */
export const root = new URL("../", import.meta.url);
/** The package folder. */
export const pkgDir = process.env.ONNX_GENERATE_PKG
  ? new URL(`file://${process.env.ONNX_GENERATE_PKG.replace(/\/?$/, "/")}`)
  : new URL("pkg/", root);
const pkg = await import(new URL("onnx_generate.js", pkgDir));
pkg.initSync({ module: await readFile(new URL("onnx_generate_bg.wasm", pkgDir)) });

export const { Model } = pkg;
