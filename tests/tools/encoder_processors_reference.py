"""transformers 4.57 `generate()` on the t5 fixture with the encoder processors
(`encoder_repetition_penalty`, `encoder_no_repeat_ngram_size`), greedy and with beams. Writes
tests/fixtures/encoder_processors_reference.json, compared by tests/encoder_processors.rs.

    .realmodels/venv/bin/python tests/tools/encoder_processors_reference.py
"""

import json
import pathlib

import torch
from transformers import T5ForConditionalGeneration

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ROOT / "fixtures" / "models" / "t5"
OUT = ROOT / "fixtures" / "encoder_processors_reference.json"

PROMPTS = [[99, 203, 60, 1], [12, 40, 40, 77, 301, 5, 1], [250, 250, 9, 1]]
OPTIONS = [
    {"max_new_tokens": 10, "encoder_repetition_penalty": 1.8},
    {"max_new_tokens": 10, "encoder_repetition_penalty": 0.5},
    {"max_new_tokens": 10, "encoder_no_repeat_ngram_size": 1},
    {"max_new_tokens": 10, "encoder_no_repeat_ngram_size": 2, "encoder_repetition_penalty": 1.3},
]


def main():
    model = T5ForConditionalGeneration.from_pretrained(MODEL).eval()
    cases = []
    for options in OPTIONS:
        for prompt in PROMPTS:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), do_sample=False, **options)
            ids = out[0].tolist()[1:]  # without decoder_start_token_id
            eos = model.generation_config.eos_token_id
            finish = "eos" if eos in ids else "length"
            if eos in ids:
                ids = ids[: ids.index(eos)]
            cases.append({"prompt": prompt, "options": options, "new_token_ids": ids, "finish_reason": finish})
    OUT.write_text(json.dumps({"cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases")


if __name__ == "__main__":
    main()
