"""A short SDK run whose work is counted exactly, for the metrics test (test/e2e/operations.test.ts).

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_ops.py MODEL

Three forward_backward + optim_step steps, one save for sampling, one sample call. Prints one
JSON object: how many of each op ran, the tokens trained (forward_backward inputs) and sampled.
"""
import json
import sys

import numpy as np
import tinker
from tinker import types

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Tinker runs training loops on your own GPUs."]


def main() -> None:
    model = sys.argv[1]
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    datums = []
    for text in TEXTS:
        ids = tok.encode(text)
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64), "weights": np.ones(len(ids) - 1, dtype=np.float32)},
            )
        )
    steps = 3
    for _ in range(steps):
        tc.forward_backward(datums, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(
        types.ModelInput.from_ints(tok.encode("The quick brown")),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=3),
    ).result()
    print(
        json.dumps(
            {
                "model_id": tc.model_id,
                "ops": {"create_model": 1, "forward_backward": steps, "optim_step": steps, "save_weights_for_sampler": 1, "sample": 1},
                "trained_tokens": steps * sum(d.model_input.length for d in datums),
                "sampled_tokens": sum(len(s.tokens) for s in res.sequences),
            }
        )
    )


if __name__ == "__main__":
    main()
