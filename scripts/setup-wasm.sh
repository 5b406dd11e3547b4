#!/bin/sh
# Install what the wasm build and tests need; idempotent and quick when everything is there.
#   rustup target wasm32-unknown-unknown, the nightly toolchain with rust-src (the threads
#   build rebuilds std: scripts/build-wasm.sh --threads), wasm-bindgen-cli (the version of Cargo.lock),
#   Debian's chromium + chromium-driver, npm dev dependencies (typescript,
#   playwright-core, and deno and wrangler (with workerd) for the edge examples), the
#   benchmark's npm dependencies (bench/).
set -eu
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
  rustup target add wasm32-unknown-unknown
fi

# The threads build: nightly with rust-src (-Z build-std needs std's sources).
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "setup-wasm: installing the nightly toolchain with rust-src"
  rustup toolchain install nightly --profile minimal --component rust-src
elif ! rustup component list --toolchain nightly --installed | grep -q '^rust-src'; then
  rustup component add rust-src --toolchain nightly
fi

# wasm-bindgen's CLI must match the wasm-bindgen crate of Cargo.lock exactly.
want=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
have=$(wasm-bindgen --version 2>/dev/null | awk '{print $2}' || true)
if [ "$have" != "$want" ]; then
  echo "setup-wasm: installing wasm-bindgen-cli $want (found '${have:-none}')"
  # Without --locked: with it a pinned dependency is missing.
  cargo install wasm-bindgen-cli --version "$want"
fi

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  echo "setup-wasm: installing chromium and chromium-driver"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update
  $SUDO apt-get install -y chromium chromium-driver
fi

if ! command -v node >/dev/null 2>&1; then
  echo "setup-wasm: node (>= 20) and npm are required" >&2
  exit 1
fi

if [ ! -d node_modules/typescript ] || [ ! -d node_modules/playwright-core ] ||
  [ ! -d node_modules/deno ] || [ ! -d node_modules/wrangler ] || [ ! -d node_modules/binaryen ] ||
  [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi
# The benchmark's own dependencies (transformers.js, its onnxruntime-web, wabt). transformers.js
# depends on onnxruntime-node, whose install script would download CUDA files: skip it (the
# benchmark uses onnxruntime-web's wasm backend only).
if [ ! -d bench/node_modules/@huggingface/transformers ] ||
  [ bench/package-lock.json -nt bench/node_modules/.package-lock.json ]; then
  (cd bench && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund)
fi
echo "setup-wasm: ok"
