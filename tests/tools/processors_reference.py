"""Reference outputs of transformers 4.57's logits processor chain on random scores.

Builds the chain with `GenerationMixin._get_logits_processor` (the same function `generate()`
uses, so the order and the constructor arguments are transformers' own) for a list of option
sets, applies it to random float32 scores, and writes tests/fixtures/processors_reference.json,
which tests/processors_reference.rs compares against `Chain::build`.

    .realmodels/venv/bin/python tests/tools/processors_reference.py
"""

import json
import math
import pathlib

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

VOCAB = 64
EOS = [2, 5]
OUT = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "processors_reference.json"

CASES = [
    ("repetition_penalty", {"repetition_penalty": 1.5}),
    ("repetition_penalty_below_one", {"repetition_penalty": 0.6}),
    ("no_repeat_ngram_3", {"no_repeat_ngram_size": 3}),
    ("encoder_repetition_penalty", {"encoder_repetition_penalty": 1.7}),
    ("encoder_no_repeat_ngram_2", {"encoder_no_repeat_ngram_size": 2}),
    ("bad_words_multi", {"bad_words_ids": [[7], [11, 13], [2], [40, 41, 42]]}),
    ("sequence_bias", {"sequence_bias": [[[9], 2.5], [[3, 4], -3.0], [[12], -1.25]]}),
    ("min_length", {"min_length": 40}),
    ("min_new_tokens", {"min_new_tokens": 30}),
    ("forced_eos", {"forced_eos_token_id": [2, 5], "max_new_tokens": 5}),
    ("forced_eos_not_yet", {"forced_eos_token_id": [2], "max_new_tokens": 9}),
    ("exponential_decay", {"exponential_decay_length_penalty": [2, 1.3]}),
    ("suppress_and_begin", {"suppress_tokens": [1, 3], "begin_suppress_tokens": [4]}),
    ("renormalize", {"renormalize_logits": True, "repetition_penalty": 1.2}),
    ("temperature", {"do_sample": True, "temperature": 0.7, "top_k": 0}),
    ("top_k_5", {"do_sample": True, "top_k": 5}),
    ("top_p_0.6", {"do_sample": True, "top_k": 0, "top_p": 0.6}),
    ("top_p_0.3_temp", {"do_sample": True, "top_k": 0, "top_p": 0.3, "temperature": 1.5}),
    ("min_p_0.1", {"do_sample": True, "top_k": 0, "min_p": 0.1}),
    ("min_p_0.02_topk", {"do_sample": True, "top_k": 20, "min_p": 0.02}),
    ("typical_0.3", {"do_sample": True, "top_k": 0, "typical_p": 0.3}),
    ("typical_0.9", {"do_sample": True, "top_k": 0, "typical_p": 0.9}),
    ("epsilon_0.01", {"do_sample": True, "top_k": 0, "epsilon_cutoff": 0.01}),
    ("eta_0.05", {"do_sample": True, "top_k": 0, "eta_cutoff": 0.05}),
    ("eta_0.0009", {"do_sample": True, "top_k": 0, "eta_cutoff": 0.0009}),
    ("everything", {
        "do_sample": True, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2,
        "bad_words_ids": [[8], [20, 21]], "min_new_tokens": 3, "suppress_tokens": [6],
        "temperature": 0.9, "top_k": 30, "top_p": 0.95, "min_p": 0.01, "typical_p": 0.97,
        "epsilon_cutoff": 0.001, "eta_cutoff": 0.001, "renormalize_logits": True,
    }),
    ("beam_sampling_keeps_eos_plus_one", {"do_sample": True, "num_beams": 2, "top_k": 1, "top_p": 0.01}),
]


class Dummy:
    """Just enough of a model for `_get_logits_processor`."""

    _merge_criteria_processor_list = GenerationMixin._merge_criteria_processor_list

    class config:
        @staticmethod
        def get_text_config():
            return None


def main():
    gen = torch.Generator().manual_seed(1234)
    out = []
    for name, options in CASES:
        for variant in range(3):
            prompt_len = 6 + variant * 3
            new = 4 + variant
            ids = torch.randint(0, 16, (1, prompt_len + new), generator=gen)
            encoder_ids = torch.randint(0, 16, (1, 7), generator=gen)
            scores = torch.randn(1, VOCAB, generator=gen) * 3.0
            scores[0, 60] = -math.inf
            config = GenerationConfig(**{k: v for k, v in options.items() if k != "max_new_tokens"})
            config.eos_token_id = EOS
            config._eos_token_tensor = torch.tensor(EOS)
            max_new = options.get("max_new_tokens", 20)
            config.max_length = prompt_len + max_new
            if config.min_new_tokens is not None:
                config.min_length = config.min_new_tokens + prompt_len
            if "sequence_bias" in options:
                config.sequence_bias = {tuple(k): v for k, v in options["sequence_bias"]}
            decoder_only = not name.startswith("encoder_")
            processors = GenerationMixin._get_logits_processor(
                Dummy(),
                generation_config=config,
                input_ids_seq_length=prompt_len,
                encoder_input_ids=ids[:, :prompt_len] if decoder_only else encoder_ids,
                logits_processor=None,
                device="cpu",
                model_kwargs={},
            )
            processed = processors(ids, scores.clone())
            out.append({
                "name": f"{name}/{variant}",
                "options": options,
                "eos_token_id": EOS,
                "ids": ids[0].tolist(),
                "prompt_len": prompt_len,
                "encoder_ids": None if decoder_only else encoder_ids[0].tolist(),
                "scores": [None if x == -math.inf else float(x) for x in scores[0]],
                "expected": [None if x == -math.inf else float(x) for x in processed[0]],
                "processors": [type(p).__name__ for p in processors],
            })
    OUT.write_text(json.dumps(allow_nan=False, obj={"transformers": __import__("transformers").__version__,
                               "vocab": VOCAB, "cases": out}, indent=None) + "\n")
    print(f"wrote {len(out)} cases to {OUT}")


if __name__ == "__main__":
    main()
