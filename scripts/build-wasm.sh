#!/bin/sh
# Build the npm package in pkg/: a release build with SIMD (+simd128) for the web target, which
# also runs in Node (see the README's Node example). Prints the wasm size, raw and gzipped.
set -eu
cd "$(dirname "$0")/.."
CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-C target-feature=+simd128" \
  wasm-pack build --release --target web --out-dir pkg --out-name onnx_generate
node scripts/finish-pkg.mjs
wasm=pkg/onnx_generate_bg.wasm
raw=$(wc -c < "$wasm")
gz=$(gzip -9 -c "$wasm" | wc -c)
echo "build-wasm: $wasm is $raw bytes, $gz bytes gzipped (-9)"
