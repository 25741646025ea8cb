"""For each base model named on the command line: a LoRA training client's get_info tokenizer_id,
and the tokenizer the SDK's get_tokenizer() loads from it (its name_or_path, and whether it
round-trips a sentence). Prints one JSON object keyed by model name.

    python test/e2e/standin/tokenizer_info.py MODEL [MODEL ...]
"""

from __future__ import annotations

import json
import sys

import tinker


def main(models: list[str]) -> None:
    svc = tinker.ServiceClient()
    out = {}
    for name in models:
        tc = svc.create_lora_training_client(base_model=name, rank=4)
        info = tc.get_info()
        tok = tc.get_tokenizer()
        text = "The weather today is"
        out[name] = {
            "tokenizer_id": info.model_data.tokenizer_id,
            "loaded_from": tok.name_or_path,
            "round_trip": tok.decode(tok.encode(text, add_special_tokens=False)) == text,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
