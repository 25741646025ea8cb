"""stable_reinforce's refusals through the real SDK, and a good request after them.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_stability.py MODEL
Prints one JSON object with the error each bad request raised and the loss of the good one.
"""
import json
import sys

import numpy as np
import tinker
from tinker import types

from sdk_common import error_of

PROMPT = [5, 17, 123, 42]


def datum(seq, advantage: float = 1.0, spans: bool = True, prompt_advantage: float = 0.0, swap_token: bool = False,
          zero_prompt_targets: bool = False):
    """``zero_prompt_targets``: the prompt's targets padded with 0, as the cookbook's rl_loop does."""
    sampled = list(seq.tokens)
    ob = len(PROMPT) - 1
    targets = ([0] * ob if zero_prompt_targets else PROMPT[1:]) + sampled
    if swap_token:
        targets[ob] = (targets[ob] + 1) % 1000
    adv = np.array([prompt_advantage] + [0.0] * (ob - 1) + [advantage] * len(sampled), dtype=np.float32)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + sampled[:-1]),
        loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64), "advantages": adv},
    )
    if not spans:
        return d
    sid = seq.sequence_id
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))],
    )


def sample(client, n: int = 2):
    params = types.SamplingParams(max_tokens=5, seed=3, stop=[])
    return client.sample(types.ModelInput.from_ints(PROMPT), n, params).result(timeout=120).sequences


def main() -> None:
    model = sys.argv[1]
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    recorded = sample(tc.save_weights_and_get_sampling_client(record_stability_info=True).result())
    unrecorded = sample(tc.save_weights_and_get_sampling_client().result())
    other_session = tinker.ServiceClient()
    foreign = sample(other_session.create_sampling_client(base_model=model, record_stability_info=True))

    def fb(data):
        return tc.forward_backward(data, "stable_reinforce").result(timeout=120)

    out: dict[str, object] = {
        "no_provenance": error_of(lambda: fb([datum(recorded[0], spans=False)])),
        "not_recorded": error_of(lambda: fb([datum(unrecorded[0])])),
        "other_session": error_of(lambda: fb([datum(foreign[0])])),
        "wrong_token": error_of(lambda: fb([datum(recorded[0], swap_token=True)])),
        "prompt_advantage": error_of(lambda: fb([datum(recorded[0], prompt_advantage=0.5)])),
    }
    good = fb([datum(recorded[0], 1.0), datum(recorded[1], -1.0, zero_prompt_targets=True)])
    out["good_loss"] = good.metrics["loss:sum"]
    out["good_logprobs"] = [list(map(float, o["logprobs"].to_numpy())) for o in good.loss_fn_outputs]
    out["sampled_logprobs"] = [list(map(float, s.logprobs)) for s in recorded]
    out["n_prompt"] = len(PROMPT)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
