#!/usr/bin/env bash
# The whole test suite: native tests (golden parity, bad input, units), the wasm32 build of the
# core, and the wasm tests in Node and headless Chromium when scripts/test-wasm.sh is present.
# Installs what it needs first; every install step is skipped when already done.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

step() { printf '\n== %s\n' "$*"; }

step "toolchain"
command -v cargo >/dev/null || { echo "cargo is required (rustup)"; exit 1; }
rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown \
  || rustup target add wasm32-unknown-unknown

step "native tests"
cargo test --all-targets 2>&1 | tee target/native-tests.log
# Every test binary must have run tests: a suite that silently ran nothing is a failure.
if ! grep -qE '^test result: ok\. [1-9][0-9]* passed' target/native-tests.log; then
  echo "no native test ran"; exit 1
fi

step "golden tool"
for m in llama gpt2 gpt2-nopos gpt2-merged; do
  cargo run -q --example golden -- --model "tests/fixtures/models/$m" --cases "tests/fixtures/golden/$m.json" \
    | tail -n 1 | sed "s/^/$m: /"
done

step "core builds for wasm32"
cargo build --lib --target wasm32-unknown-unknown

if [ -f scripts/test-wasm.sh ]; then
  step "wasm tests (Node, headless Chromium, package, demo page)"
  bash scripts/test-wasm.sh
fi
echo
echo "all tests passed"
