"""Sampler kinds: an inflight sampling client follows its training model's newest inflight save.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_inflight.py MODEL_ALIAS

One LoRA training client. A snapshot client and an inflight client are created from the initial
weights; the model trains a step (cross_entropy, a large learning rate, so its prompt logprobs
move); a second inflight save follows; the model trains again and saves a *snapshot* (which must
not move the inflight target), then trains again and saves inflight a third time. After each save
every client scores the same prompt (compute_logprobs). Prints one JSON object: the logprobs of
each client after each stage.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types

PROMPT = [5, 17, 123, 42, 7, 300, 9, 11, 64, 2]


def score(client) -> list[float]:
    return [float(v) for v in client.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:]]


def train_step(tc) -> float:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(PROMPT[1:], dtype=np.int64))},
    )
    fb = tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return float(fb.metrics["loss:sum"])


def main() -> None:
    alias = sys.argv[1]
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=alias, rank=4, seed=7)
    tc = tc.result() if hasattr(tc, "result") else tc
    snap0 = tc.save_weights_and_get_sampling_client().result()
    inf_a = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    out: dict = {"stage0": {"snap0": score(snap0), "inf_a": score(inf_a)}}

    out["loss1"] = train_step(tc)
    inf_b = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    out["stage1"] = {"snap0": score(snap0), "inf_a": score(inf_a), "inf_b": score(inf_b)}

    out["loss2"] = train_step(tc)
    snap2 = tc.save_weights_and_get_sampling_client().result()  # a snapshot save: the inflight target stays
    out["stage2"] = {"snap2": score(snap2), "inf_a": score(inf_a), "inf_b": score(inf_b)}

    out["loss3"] = train_step(tc)
    inf_c = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    out["stage3"] = {"snap0": score(snap0), "snap2": score(snap2), "inf_a": score(inf_a),
                     "inf_b": score(inf_b), "inf_c": score(inf_c)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
