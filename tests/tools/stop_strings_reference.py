"""Reference decisions of transformers 4.57's `StopStringCriteria` on the fixture tokenizers.

For random token sequences and stop strings (substrings of their text, and a few that do not
occur), records after each token whether the criterion stops. Writes
tests/fixtures/stop_strings_reference.json, compared by tests/stop_strings_reference.rs.

    .realmodels/venv/bin/python tests/tools/stop_strings_reference.py
"""

import json
import pathlib
import random

import torch
from transformers import PreTrainedTokenizerFast
from transformers.generation.stopping_criteria import StopStringCriteria

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "fixtures" / "stop_strings_reference.json"


def main():
    rng = random.Random(99)
    cases = []
    for model in ["llama", "gpt2"]:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "fixtures" / "models" / model / "tokenizer.json"))
        special = set(tok.all_special_ids)
        usable = [i for i in range(len(tok)) if i not in special and tok.decode([i]).isprintable()
                  and "\ufffd" not in tok.decode([i])]
        for n in range(40):
            ids = [rng.choice(usable) for _ in range(12)]
            text = tok.decode(ids)
            stops = []
            for _ in range(2):
                a = rng.randrange(0, max(1, len(text) - 3))
                b = min(len(text), a + rng.randint(2, 6))
                if text[a:b].strip():
                    stops.append(text[a:b])
            stops.append("zzqx" if n % 2 else "\u00e9t\u00e9")
            criteria = StopStringCriteria(tokenizer=tok, stop_strings=stops)
            stop_after = []
            for k in range(1, len(ids) + 1):
                hit = criteria(torch.tensor([ids[:k]]), torch.zeros(1, len(tok)))
                stop_after.append(bool(hit[0]))
            cases.append({"model": model, "ids": ids, "stop_strings": stops, "stop_after": stop_after})
    OUT.write_text(json.dumps({"cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases, {sum(any(c['stop_after']) for c in cases)} with a stop")


if __name__ == "__main__":
    main()
