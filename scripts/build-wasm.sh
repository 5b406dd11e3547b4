#!/bin/sh
# Build the npm package in pkg/: a release build with SIMD (+simd128) for the web target, which
# also runs in Node (see the README's Node example). Prints the wasm size, raw and gzipped.
# Uses wasm-pack (scripts/setup-wasm.sh installs it); WASM_PACK=0 runs the same steps with
# cargo and wasm-bindgen directly.
set -eu
cd "$(dirname "$0")/.."
export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-C target-feature=+simd128"
if [ "${WASM_PACK:-1}" != 0 ] && command -v wasm-pack >/dev/null 2>&1; then
  wasm-pack build --release --target web --out-dir pkg --out-name onnx_generate
else
  cargo build --release --target wasm32-unknown-unknown --lib
  rm -rf pkg
  wasm-bindgen --target web --out-dir pkg --out-name onnx_generate \
    "${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/release/onnx_generate.wasm"
fi
node scripts/finish-pkg.mjs
wasm=pkg/onnx_generate_bg.wasm
raw=$(wc -c < "$wasm")
gz=$(gzip -9 -c "$wasm" | wc -c)
echo "build-wasm: $wasm is $raw bytes, $gz bytes gzipped (-9)"
