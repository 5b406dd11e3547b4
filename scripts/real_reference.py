"""Expected greedy ids of SmolLM2-135M-Instruct under onnxruntime, for tests/real_models.rs.

Run once with the real-model environment (torch/transformers/onnxruntime), from the
repository root:

    .realmodels/venv/bin/python scripts/real_reference.py [MODELS_DIR]

MODELS_DIR defaults to `.realmodels` (the folder of `smollm2/tjs` and
`smollm2/genai_int4_cpu`). Writes tests/fixtures/real/smollm2.json: the chat prompt's ids
(transformers' `apply_chat_template(..., add_generation_prompt=True)`), and for each ONNX
file the first 32 greedy new token ids onnxruntime produces (stopping early at the eos id,
which is not included, as transformers' generate() reports new tokens).

For the int8 file (`model_quantized`, DynamicQuantizeLinear -> MatMulInteger) also the greedy
ids of ONNX's own reference implementation (`onnx.reference`, exact integer products) fed one
token a step (`model_quantized_stepwise`). DynamicQuantizeLinear takes one scale for all the
tokens of a step, and with the whole prompt in one step that scale comes from the prompt's
largest activations, which makes the logits of that step differ by several units between
implementations (onnxruntime without its graph optimisations picks another first token than
onnxruntime with them and the reference). One token a step, the scale is each token's own, and this
crate's logits after the prompt differ from the reference's by 0.3 on average (at most 1.7),
with the same greedy ids.
"""

import json
import os
import sys

import numpy as np
import onnxruntime as ort
from transformers import AutoTokenizer

ROOT = sys.argv[1] if len(sys.argv) > 1 else ".realmodels"
TJS = os.path.join(ROOT, "smollm2", "tjs")
QUESTION = "What is the capital of France?"
NEW_TOKENS = 32
EOS = 2
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def greedy(path, prompt, with_positions):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    types = {i.name: i.type for i in sess.get_inputs()}
    past = {}
    for l in range(LAYERS):
        for kind in ("key", "value"):
            name = f"past_key_values.{l}.{kind}"
            dtype = np.float16 if types[name] == "tensor(float16)" else np.float32
            past[name] = np.zeros((1, KV_HEADS, 0, HEAD_DIM), dtype)
    ids = list(prompt)
    new_ids = []
    feed_ids = list(prompt)
    for _ in range(NEW_TOKENS):
        total = len(ids)
        feeds = {
            "input_ids": np.array([feed_ids], np.int64),
            "attention_mask": np.ones((1, total), np.int64),
        }
        if with_positions and "position_ids" in names:
            start = total - len(feed_ids)
            feeds["position_ids"] = np.arange(start, total, dtype=np.int64)[None, :]
        feeds.update(past)
        outs = sess.run(None, feeds)
        out_names = [o.name for o in sess.get_outputs()]
        logits = outs[out_names.index("logits")]
        token = int(np.argmax(logits[0, -1]))
        for l in range(LAYERS):
            for kind in ("key", "value"):
                past[f"past_key_values.{l}.{kind}"] = outs[out_names.index(f"present.{l}.{kind}")]
        if token == EOS:
            break
        new_ids.append(token)
        ids.append(token)
        feed_ids = [token]
    return new_ids


def greedy_reference_stepwise(path, prompt):
    """Greedy ids of `onnx.reference` on the file, every token (prompt and new) in a step."""
    from onnx.reference import ReferenceEvaluator

    sess = ReferenceEvaluator(path)
    past = {
        f"past_key_values.{l}.{kind}": np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32)
        for l in range(LAYERS)
        for kind in ("key", "value")
    }
    new_ids = []
    pending = list(prompt)
    position = 0
    while len(new_ids) < NEW_TOKENS:
        for token in pending:
            feeds = {
                "input_ids": np.array([[token]], np.int64),
                "attention_mask": np.ones((1, position + 1), np.int64),
                "position_ids": np.array([[position]], np.int64),
            }
            feeds.update(past)
            outs = dict(zip(sess.output_names, sess.run(None, feeds)))
            for l in range(LAYERS):
                for kind in ("key", "value"):
                    past[f"past_key_values.{l}.{kind}"] = outs[f"present.{l}.{kind}"]
            position += 1
        token = int(np.argmax(outs["logits"][0, -1]))
        if token == EOS:
            break
        new_ids.append(token)
        pending = [token]
    return new_ids


def main():
    tok = AutoTokenizer.from_pretrained(TJS)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = [int(t) for t in prompt]
    files = {
        "genai_int4_cpu": (os.path.join(ROOT, "smollm2", "genai_int4_cpu", "model.onnx"), False),
        "model_q4": (os.path.join(TJS, "onnx", "model_q4.onnx"), True),
        "model_quantized": (os.path.join(TJS, "onnx", "model_quantized.onnx"), True),
        "model_fp16": (os.path.join(TJS, "onnx", "model_fp16.onnx"), True),
        "model": (os.path.join(TJS, "onnx", "model.onnx"), True),
    }
    expected = {}
    for name, (path, positions) in files.items():
        try:
            ids = greedy(path, prompt, positions)
        except Exception as e:  # a variant onnxruntime cannot run is left out
            print(f"{name}: {e}", file=sys.stderr)
            continue
        expected[name] = {"ids": ids, "text": tok.decode(ids)}
        print(name, ids, repr(tok.decode(ids)))
    name = "model_quantized_stepwise"
    ids = greedy_reference_stepwise(files["model_quantized"][0], prompt)
    expected[name] = {"ids": ids, "text": tok.decode(ids)}
    print(name, ids, repr(tok.decode(ids)))
    out = {
        "question": QUESTION,
        "prompt_ids": prompt,
        "max_new_tokens": NEW_TOKENS,
        "onnxruntime": ort.__version__,
        "expected": expected,
    }
    with open(os.path.join("tests", "fixtures", "real", "smollm2.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
