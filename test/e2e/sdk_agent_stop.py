"""A training client whose worker agent goes away, through the plain Tinker SDK.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_agent_stop.py MODEL

Creates a LoRA training client and runs one forward_backward + optim_step, then prints
{"model_id": ..., "loss": ...}. For each line "burst" on stdin it sends 32 greedy samples of the base
model at once and prints {"burst": [token counts]}; any other line (the caller has stopped the model's
agent) goes on. Then tries
one more forward_backward on the model and samples greedily from the base model, and prints one JSON
object: the error the training future raised ("" if none) and the sampled tokens (or the sampling
error). Every wait is bounded.
"""
import json
import sys

import numpy as np
import tinker
from tinker import types

from sdk_common import error_of

TIMEOUT_S = 180


def main() -> None:
    model = sys.argv[1]
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=model, rank=8, seed=1).result(timeout=TIMEOUT_S)
    tok = tc.get_tokenizer()
    ids = tok.encode("A small model learns these lines by heart.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(ids[1:], dtype=np.int64),
            "weights": np.ones(len(ids) - 1, dtype=np.float32),
        },
    )
    fb = tc.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT_S)
    print(json.dumps({"model_id": tc.model_id, "loss": float(fb.metrics["loss:sum"])}), flush=True)

    sampler = service.create_sampling_client(base_model=model).result(timeout=TIMEOUT_S)
    prompt = types.ModelInput.from_ints(tok.encode("The quick brown"))
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    # Each "burst" line: 32 greedy samples at once; any other line goes on.
    while sys.stdin.readline().strip() == "burst":
        burst = [sampler.sample(prompt, num_samples=1, sampling_params=greedy) for _ in range(32)]
        print(json.dumps({"burst": [len(f.result(timeout=TIMEOUT_S).sequences[0].tokens) for f in burst]}), flush=True)

    after_stop_error = error_of(lambda: tc.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT_S))

    sample: dict = {}

    def run_sample() -> None:
        res = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result(timeout=TIMEOUT_S)
        sample["tokens"] = list(res.sequences[0].tokens)

    sample_error = error_of(run_sample)
    print(json.dumps({"after_stop_error": after_stop_error, "sample_tokens": sample.get("tokens"), "sample_error": sample_error}), flush=True)


if __name__ == "__main__":
    main()
