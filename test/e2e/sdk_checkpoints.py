"""Checkpoints through the real Tinker SDK.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_checkpoints.py MODEL PHASE [ARG]
  PHASE resume        save_state -> create_training_client_from_state[_with_optimizer] -> one
                      identical step on the original and on each resumed client
  PHASE sampler       saves sampler weights at step 5, trains 10 more steps, and scores a fixed
                      prompt with the step-5 weights before and after those steps
  PHASE rescore PATH  scores the same prompt with the sampler weights at PATH (after a restart)
  PHASE bad           bad checkpoint input: each error, and proof the model state did not change
Prints one JSON object.
"""
import json
import sys

import numpy as np
import tinker
from tinker import types

from sdk_common import error_of

PROMPT = [7, 42, 99, 5, 300, 12, 8, 77]


def batch(step: int) -> list[types.Datum]:
    out = []
    for i in range(3):
        toks = [(step * 13 + i * 31 + j * 7) % 900 + 1 for j in range(10)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": np.array(toks[1:], dtype=np.int64), "weights": np.ones(9, dtype=np.float32)},
            )
        )
    return out


ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def step(tc, i: int) -> float:
    fb = tc.forward_backward(batch(i), "cross_entropy")
    opt = tc.optim_step(ADAM)
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return float(loss)


def forward_loss(tc, i: int) -> float:
    return float(tc.forward(batch(i), "cross_entropy").result().metrics["loss:sum"])


def score(svc, path: str) -> list:
    sc = svc.create_sampling_client(model_path=path).result()
    return sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()




def main() -> None:
    model, phase = sys.argv[1], sys.argv[2]
    svc = tinker.ServiceClient()
    out: dict[str, object] = {}
    if phase == "resume":
        tc = svc.create_lora_training_client(base_model=model, rank=4, seed=11).result()
        for i in range(3):
            step(tc, i)
        path = tc.save_state("resume-point").result().path
        with_opt = svc.create_training_client_from_state_with_optimizer(path).result()
        without = svc.create_training_client_from_state(path).result()
        out["path"] = path
        out["ids"] = [tc.model_id, with_opt.model_id, without.model_id]
        # Right after loading, all three hold the same weights.
        out["loaded_loss"] = [forward_loss(c, 3) for c in (tc, with_opt, without)]
        # One identical step on each, then the loss of the next batch.
        out["step_loss"] = [step(c, 3) for c in (tc, with_opt, without)]
        out["after_loss"] = [forward_loss(c, 4) for c in (tc, with_opt, without)]
        info = svc.create_rest_client().get_weights_info_by_tinker_path(path).result()
        out["weights_info"] = {"base_model": info.base_model, "is_lora": info.is_lora, "lora_rank": info.lora_rank}
    elif phase == "sampler":
        tc = svc.create_lora_training_client(base_model=model, rank=4, seed=12).result()
        for i in range(5):
            step(tc, i)
        path = tc.save_weights_for_sampler("step-5").result().path
        out["path"] = path
        out["at_save"] = score(svc, path)
        for i in range(5, 15):
            step(tc, i)
        out["after_training"] = score(svc, path)
        out["live"] = score(svc, tc.save_weights_for_sampler("step-15").result().path)
        ckpts = svc.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
        out["checkpoints"] = sorted(c.checkpoint_id for c in ckpts)
    elif phase == "rescore":
        out["after_restart"] = score(svc, sys.argv[3])
    elif phase == "bad":
        tc = svc.create_lora_training_client(base_model=model, rank=4, seed=13).result()
        other = svc.create_lora_training_client(base_model=model, rank=8, seed=13).result()
        step(tc, 0)
        before = forward_loss(tc, 1)
        other_path = other.save_state("rank-8").result().path
        out["missing"] = error_of(lambda: tc.load_state(f"tinker://{tc.model_id}/weights/never-saved").result())
        out["incompatible"] = error_of(lambda: tc.load_state(other_path).result())
        out["sampler_path"] = error_of(lambda: tc.load_state(tc.save_weights_for_sampler("s").result().path).result())
        out["malformed"] = error_of(lambda: tc.load_state("tinker://nope").result())
        out["duplicate_name"] = error_of(lambda: tc.save_state("rank-8-dup").result() and tc.save_state("rank-8-dup").result())
        out["unchanged"] = forward_loss(tc, 1) == before
        out["still_trains"] = step(tc, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
