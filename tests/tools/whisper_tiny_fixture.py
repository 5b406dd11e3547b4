"""A tiny random-weight Whisper in the optimum layout, for the tests that need no real model.

Run once with the Python environment of scripts/real-models.sh:
    .realmodels/venv/bin/python tests/tools/whisper_tiny_fixture.py
Writes tests/fixtures/models/whisper-tiny/ (encoder_model.onnx, decoder_model_merged.onnx,
decoder_model.onnx, decoder_with_past_model.onnx, JSON files, a GPT-2 fixture tokenizer with
Whisper's special tokens added), tests/fixtures/whisper/encoder_d48.onnx (the encoder of a model
with another hidden size, for the mismatch test) and tests/fixtures/whisper/tiny_steps.json:
onnxruntime's logits for a 4-token decoder prompt then two one-token steps (the self-attention
mask sub-graph that tract once mis-derived).
"""
import json, shutil, subprocess, sys, tempfile
from pathlib import Path
import numpy as np
import onnxruntime as ort
import torch
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

repo = Path(__file__).resolve().parent.parent.parent
out = repo / "tests/fixtures/models/whisper-tiny"
optimum = Path(sys.executable).parent / "optimum-cli"

# GPT-2 fixture tokenizer (512 tokens + <|endoftext|> at 0) with Whisper's special tokens.
tok = json.loads((repo / "tests/fixtures/models/gpt2/tokenizer.json").read_text())
specials = ["<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
            "<|notimestamps|>"]
base = len(tok["model"]["vocab"])
ids = {t: base + i for i, t in enumerate(specials)}
for t, i in ids.items():
    tok["added_tokens"].append({"id": i, "content": t, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
VOCAB = base + len(specials) + 2


def model(d_model, seed):
    torch.manual_seed(seed)
    c = WhisperConfig(vocab_size=VOCAB, d_model=d_model, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=64,
                      decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=0,
                      bos_token_id=0, pad_token_id=0, suppress_tokens=[], begin_suppress_tokens=[0])
    return WhisperForConditionalGeneration(c).eval()


def export(m, dest):
    with tempfile.TemporaryDirectory() as hf:
        m.save_pretrained(hf)
        subprocess.run([str(optimum), "export", "onnx", "--model", hf, "--task",
                        "automatic-speech-recognition-with-past", str(dest)],
                       check=True, capture_output=True)


with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    export(model(32, 0), tmp / "tiny")
    export(model(48, 1), tmp / "wide")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in ["encoder_model.onnx", "decoder_model_merged.onnx", "decoder_model.onnx",
              "decoder_with_past_model.onnx", "config.json"]:
        shutil.copy(tmp / "tiny" / f, out / f)
    shutil.copy(tmp / "wide/encoder_model.onnx", repo / "tests/fixtures/whisper/encoder_d48.onnx")

(out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
WhisperFeatureExtractor(feature_size=80).save_pretrained(str(out))
(out / "generation_config.json").write_text(json.dumps({
    "decoder_start_token_id": ids["<|startoftranscript|>"], "eos_token_id": 0, "pad_token_id": 0,
    "bos_token_id": 0, "max_length": 12, "begin_suppress_tokens": [0], "suppress_tokens": [],
    "no_timestamps_token_id": ids["<|notimestamps|>"],
    "lang_to_id": {"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]},
    "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
}, indent=1))

# Reference steps with onnxruntime: a fixed mel window, prompt of 4 tokens, then 2 tokens.
mel = ((np.arange(80 * 3000) % 97).astype(np.float32) / 97.0 - 0.5).reshape(1, 80, 3000)
hidden = ort.InferenceSession(str(out / "encoder_model.onnx")).run(None, {"input_features": mel})[0]
prompt = [ids["<|startoftranscript|>"], ids["<|en|>"], ids["<|transcribe|>"], ids["<|notimestamps|>"]]
first = ort.InferenceSession(str(out / "decoder_model.onnx"))
names = [o.name for o in first.get_outputs()]
res = first.run(None, {"input_ids": np.array([prompt], np.int64), "encoder_hidden_states": hidden})
steps = [{"tokens": prompt, "last_logits": res[0][0, -1].tolist()}]
past = {n.replace("present", "past_key_values"): v for n, v in zip(names[1:], res[1:])}
later = ort.InferenceSession(str(out / "decoder_with_past_model.onnx"))
later_names = [o.name for o in later.get_outputs()]
for t in (17, 42):
    res = later.run(None, dict(input_ids=np.array([[t]], np.int64), **past))
    steps.append({"tokens": [t], "last_logits": res[0][0, -1].tolist()})
    for n, v in zip(later_names[1:], res[1:]):
        past[n.replace("present", "past_key_values")] = v
(repo / "tests/fixtures/whisper/tiny_steps.json").write_text(json.dumps({
    "mel": "((i % 97) / 97 - 0.5) for i in 0..80*3000, row-major [80, 3000]",
    "source": "onnxruntime on decoder_model.onnx then decoder_with_past_model.onnx",
    "steps": steps}))
print("vocab", VOCAB, "special ids", ids)
