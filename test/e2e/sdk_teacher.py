"""A frozen teacher served by base_model name while an actor trains (preset cpu/tiny_teacher.yaml).

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_teacher.py ACTOR TEACHER
Prints one JSON object.
"""
import json
import sys

import numpy as np
import tinker
from tinker import types

from sdk_common import error_of

PROMPT = [5, 17, 42, 99, 7, 300, 12]




def main() -> None:
    actor, teacher = sys.argv[1], sys.argv[2]
    svc = tinker.ServiceClient()
    caps = {m.model_name: {"trainable": m.trainable, "sampleable": m.sampleable} for m in svc.get_server_capabilities().supported_models}
    tc = svc.create_lora_training_client(base_model=actor, rank=4, seed=0).result()
    t = svc.create_sampling_client(base_model=teacher).result()
    a = svc.create_sampling_client(base_model=actor).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": np.array(PROMPT[1:], dtype=np.int64), "weights": np.ones(len(PROMPT) - 1, dtype=np.float32)},
    )
    out: dict[str, object] = {"caps": caps}
    teacher_lp, losses = [], []
    for _ in range(3):
        # Training step and teacher scoring submitted together: both are served.
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        scored = t.compute_logprobs(types.ModelInput.from_ints(PROMPT))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
        teacher_lp.append(scored.result())
    out["losses"] = losses
    out["teacher_logprobs"] = teacher_lp
    out["actor_base_logprobs"] = a.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    topk = t.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    out["topk"] = [None if row is None else [[int(i), float(lp)] for i, lp in row] for row in topk.topk_prompt_logprobs]
    out["prompt_logprobs"] = topk.prompt_logprobs
    out["topk_too_large"] = error_of(
        lambda: t.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=50).result()
    )
    out["train_teacher"] = error_of(lambda: svc.create_lora_training_client(base_model=teacher, rank=4).result())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
