"""Bad input through the real Tinker SDK: each mistake gets a clear error, and the client keeps working.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_bad_input.py MODEL
Prints one JSON object with the error messages the SDK raised and the results that followed.
"""
import json
import sys

import numpy as np
import tinker
from tinker import types

from sdk_common import error_of


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": np.ones(len(tokens) - 1, dtype=np.float32)},
    )




def main() -> None:
    model = sys.argv[1]
    service = tinker.ServiceClient()
    out: dict[str, object] = {}
    out["unknown_model"] = error_of(lambda: service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result(timeout=60))
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    good = [datum([5, 6, 7, 8, 9])]
    out["oov_token"] = error_of(lambda: tc.forward_backward([datum([5, 6, 999999])], "cross_entropy").result(timeout=60))
    out["unknown_loss"] = error_of(lambda: tc.forward_backward(good, "no_such_loss").result(timeout=60))
    # The client used up those seq_ids; the next calls must still run, not wait for them.
    fb = tc.forward_backward(good, "cross_entropy").result(timeout=60)
    out["after_errors_loss"] = fb.metrics["loss:sum"]
    out["after_errors_optim"] = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60).metrics
    sampler = service.create_sampling_client(base_model=model)
    out["oov_prompt"] = error_of(
        lambda: sampler.sample(types.ModelInput.from_ints([1, 999999]), 1, types.SamplingParams(max_tokens=2)).result(timeout=60)
    )
    out["sample_ok"] = list(sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2, seed=1)).result(timeout=60).sequences[0].tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
