#!/bin/sh
# Build the package and serve the demo page on 127.0.0.1 (Ctrl-C stops it).
#   scripts/demo.sh [--port 8080] [--model DIR]
# --model DIR serves a model folder of this machine (for example .realmodels/smollm2/tjs built
# by the real-model script) and opens the page on it; any folder URL, such as a Hugging Face
# hub URL https://huggingface.co/ORG/REPO/resolve/main/, can be typed into the page or given
# as ?model=URL. SKIP_BUILD=1 serves an existing pkg/.
set -eu
cd "$(dirname "$0")/.."
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -f pkg/onnx_generate_bg.wasm ]; then
  sh scripts/build-wasm.sh
fi
exec node scripts/serve.mjs "$@"
