#!/bin/sh
# Build the npm package in pkg/: the wasm-package profile of Cargo.toml (dependencies optimised
# for size, fat LTO) with SIMD (+simd128) for the web target, which also runs in Node (see the
# README's Node example), and the same with relaxed SIMD as pkg/onnx_generate_bg_relaxed.wasm
# (below); cargo and wasm-bindgen directly, then npm's binaryen (a devDependency) merges the
# functions that compiled to the same code. Prints each wasm's size, raw and gzipped: each must
# stay within 3 MB gzipped (scripts/test-wasm.sh checks it).
#
# --threads builds the threads package in pkg-threads/ instead, with the same profile and
# binaryen passes: the `threads` feature (rayon) with wasm-bindgen-rayon's initThreadPool, on
# the nightly toolchain with std rebuilt for shared memory (-Z build-std,
# +atomics,+bulk-memory,+mutable-globals), in its own target folder (wasm-threads/ in the target
# folder, cold the first time). It needs a cross-origin isolated page (COOP/COEP) and Web
# Workers, so it runs in browsers, not in Node.
set -eu
cd "$(dirname "$0")/.."
threads=0
for arg in "$@"; do
  case "$arg" in
  --threads) threads=1 ;;
  *)
    echo "build-wasm: unknown option $arg (--threads builds pkg-threads/)" >&2
    exit 2
    ;;
  esac
done

# add_relaxed OUT TARGET_DIR PROFILE CARGO_COMMAND...: the same code with relaxed SIMD as well
# (+relaxed-simd: the f32 kernels multiply and add in one f32x4.relaxed_madd), built by the
# command into its own target folder (cold the first time) with the cargo profile whose output
# folder is PROFILE, as OUT/onnx_generate_bg_relaxed.wasm.
# The package's init() loads it where the engine validates relaxed SIMD and computes a probe of
# it right (Chromium, Deno, Node 22 and later; scripts/finish-pkg.mjs) and the plain one
# elsewhere (an engine without relaxed SIMD rejects the whole module).
# Both run with OUT's glue: the closure shims and casts, which wasm-bindgen names after numbers
# that differ between the builds, take OUT's names (scripts/align-exports.mjs, which fails if
# the two glue files differ otherwise).
add_relaxed() {
  relaxed_out=$1
  relaxed_dir=$2
  relaxed_profile=$3
  shift 3
  rm -f "$relaxed_out/onnx_generate_bg_relaxed.wasm"
  "$@"
  relaxed_tmp=$(mktemp -d)
  wasm-bindgen --target web --out-dir "$relaxed_tmp" --out-name onnx_generate \
    "$relaxed_dir/wasm32-unknown-unknown/$relaxed_profile/onnx_generate.wasm"
  if ! node scripts/align-exports.mjs "$relaxed_out/onnx_generate.js" \
    "$relaxed_out/onnx_generate_bg.wasm" "$relaxed_tmp/onnx_generate.js" \
    "$relaxed_tmp/onnx_generate_bg.wasm"; then
    rm -rf "$relaxed_tmp"
    exit 1
  fi
  mv "$relaxed_tmp/onnx_generate_bg.wasm" "$relaxed_out/onnx_generate_bg_relaxed.wasm"
  rm -rf "$relaxed_tmp"
}

# Both packages: the wasm-package profile of Cargo.toml.
profile=wasm-package
if [ "$threads" = 1 ]; then
  out=pkg-threads
  target_dir=${THREADS_TARGET_DIR:-${CARGO_TARGET_DIR:-target}/wasm-threads}
  # Every crate, std included, with atomics. Shared memory needs a declared maximum: 4 GiB, the
  # most wasm32 can address (the linker's default of 1 GiB is less than a 540 MB model needs
  # while it loads).
  features=+atomics,+bulk-memory,+mutable-globals,+simd128
  memory="-C link-arg=--max-memory=4294967296"
  export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-C target-feature=$features $memory"
  # The final link: a shared, imported memory and the thread-local storage symbols that
  # wasm-bindgen's thread support calls (rustc stopped adding these for +atomics in late 2025).
  # Given to this crate only (cargo rustc), so changing them rebuilds no dependency.
  link=""
  for arg in --shared-memory --import-memory --export=__wasm_init_tls --export=__tls_size \
    --export=__tls_align --export=__tls_base; do
    link="$link -C link-arg=$arg"
  done
  # shellcheck disable=SC2086
  cargo +nightly rustc --profile "$profile" --target wasm32-unknown-unknown --lib \
    --features threads --target-dir "$target_dir" -Z build-std=panic_abort,std -- $link
  rm -rf "$out"
  wasm-bindgen --target web --out-dir "$out" --out-name onnx_generate \
    "$target_dir/wasm32-unknown-unknown/$profile/onnx_generate.wasm"
  # shellcheck disable=SC2086
  add_relaxed "$out" "$target_dir-relaxed" "$profile" env \
    CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-C target-feature=$features,+relaxed-simd $memory" \
    cargo +nightly rustc --profile "$profile" --target wasm32-unknown-unknown --lib \
    --features threads --target-dir "$target_dir-relaxed" -Z build-std=panic_abort,std -- $link
else
  out=pkg
  export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-C target-feature=+simd128"
  cargo build --profile "$profile" --target wasm32-unknown-unknown --lib
  rm -rf "$out"
  wasm-bindgen --target web --out-dir "$out" --out-name onnx_generate \
    "${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/$profile/onnx_generate.wasm"
  relaxed_dir=${RELAXED_TARGET_DIR:-${CARGO_TARGET_DIR:-target}/wasm-relaxed}
  add_relaxed "$out" "$relaxed_dir" "$profile" env \
    CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-C target-feature=+simd128,+relaxed-simd" \
    cargo build --profile "$profile" --target wasm32-unknown-unknown --lib --target-dir "$relaxed_dir"
fi
# Generic code monomorphised into identical functions, merged (each round finds the callers of
# the last round's duplicates identical in turn), then unused elements dropped and locals
# renumbered: 57 KB less gzipped; then the arguments that every caller passes the same (or that
# go unused) removed and the functions that had them optimised, and branches to the end of their
# blocks dropped: 19 KB less. wasm-opt -Os/-Oz shrink the raw file but compress worse. (After
# align-exports.mjs, which compares wasm-bindgen's output of both files.)
# First, constants under 1024 added to an address folded into the load's or store's offset
# (`--optimize-added-constants-propagate`): LLVM leaves an `i32.add` per load of a kernel's
# unrolled vectors, which V8 compiles to an `lea` before each load. The fold differs from the
# add only where the sum wraps past 4 GiB onto the lowest 1024 bytes, which must then be unused
# (`--low-memory-unused`): Rust's wasm32 layout puts the stack there (stack first, from 1 MiB
# down to 0), whose lowest KiB only a stack about to overflow reaches. In Node the prompts ran
# 4-5% faster (f32's and 8-bit's prompt kernels) and a Whisper transcription 3.6%; decoding did
# not move; 21 KB less raw.
dfe=--duplicate-function-elimination
for wasm in "$out/onnx_generate_bg.wasm" "$out/onnx_generate_bg_relaxed.wasm"; do
  features=""
  case "$wasm" in *_relaxed.wasm) features=--enable-relaxed-simd ;; esac
  if [ "$threads" = 1 ]; then
    features="$features --enable-threads"
  fi
  # shellcheck disable=SC2086
  node node_modules/binaryen/bin/wasm-opt "$wasm" $features \
    --enable-simd --enable-bulk-memory \
    --enable-nontrapping-float-to-int --enable-sign-ext --enable-mutable-globals \
    --enable-multivalue --enable-reference-types \
    --low-memory-unused --optimize-added-constants-propagate \
    $dfe $dfe $dfe $dfe --remove-unused-module-elements --coalesce-locals --reorder-locals \
    --vacuum --dae-optimizing --remove-unused-brs --vacuum -o "$wasm"
done
node scripts/finish-pkg.mjs "$out"
for wasm in "$out"/onnx_generate_bg*.wasm; do
  raw=$(wc -c < "$wasm")
  gz=$(gzip -9 -c "$wasm" | wc -c)
  echo "build-wasm: $wasm is $raw bytes, $gz bytes gzipped (-9)"
done
