"""SDK 0.38 sampling fields, each checked against the engine's own full prompt logprobs.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_sampling_fields.py MODEL
Prints one JSON object: the full prompt logprobs and top-K, what each field returned, and the
error each refused field raised.
"""
import json
import os
import sys

import httpx
import numpy as np

import tinker
from tinker import types

from sdk_common import error_of

PROMPT = [5, 17, 123, 42, 7, 300, 9, 11]


def main() -> None:
    model = sys.argv[1]
    sc = tinker.ServiceClient().create_sampling_client(base_model=model)
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=2, seed=1)

    def sample(**kw):
        return sc.sample(prompt, 1, params, **kw).result(timeout=120)

    full = sample(include_prompt_logprobs=True, topk_prompt_logprobs=3)
    last3 = sample(include_prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=3)
    # target_prompt_logprobs: the prompt's own next tokens, the top-1 ids, and -1 (nothing).
    rows = len(PROMPT) - 1
    ids = np.array([[PROMPT[i + 1], full.topk_prompt_logprobs[i + 1][0][0], -1] for i in range(rows)], dtype=np.int64)
    targeted = sample(target_prompt_logprobs=types.TensorData.from_numpy(ids))
    # topk_sample_logprobs, greedy: the first entry is the chosen token; the engine's own logprobs
    # of prompt + sampled tokens (compute_logprobs) score it the same.
    greedy = sc.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0, stop=[]), topk_sample_logprobs=4).result(timeout=120)
    gseq = greedy.sequences[0]
    rescored = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT + list(gseq.tokens))).result(timeout=120)
    # prompt_alt_tokens_k at temperature 0: every draw is the argmax, scored as the top-1 prompt logprob.
    alt = sc.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=2).result(timeout=120)
    out = {
        "alt_tokens": alt.prompt_alt_tokens.tokens.to_numpy().tolist(),
        "alt_logprobs": alt.prompt_alt_tokens.logprobs.to_numpy().tolist(),
        "greedy_tokens": list(gseq.tokens),
        "greedy_topk": gseq.topk_logprobs,
        "greedy_rescored": [float(v) for v in rescored[len(PROMPT):]],
        "target_ids": ids.tolist(),
        "target": targeted.target_prompt_logprobs.to_numpy().tolist(),
        "full": full.prompt_logprobs,
        "full_topk": full.topk_prompt_logprobs,
        "last3": last3.prompt_logprobs,
        "last3_topk": last3.topk_prompt_logprobs,
        "last_n_without_logprobs": error_of(lambda: sample(prompt_logprobs_last_n=2)),
        "last_n_too_long": error_of(lambda: sample(include_prompt_logprobs=True, prompt_logprobs_last_n=len(PROMPT))),
    }
    # The server's own checks, past the SDK's (raw HTTP, as another client would send).
    def raw(**kw):
        body = {"base_model": model, "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "sampling_params": {"max_tokens": 2}, "num_samples": 1, **kw}
        r = httpx.post(os.environ["TINKER_BASE_URL"].rstrip("/") + "/api/v1/asample", json=body,
                       headers={"X-API-Key": os.environ["TINKER_API_KEY"]}, timeout=60)
        return f"{r.status_code} {r.text}"
    out["raw_without_logprobs"] = raw(prompt_logprobs_last_n=2)
    out["raw_target_bad_shape"] = raw(target_prompt_logprobs={"data": [1, 2], "dtype": "int64", "shape": [2, 1]})
    out["raw_too_long"] = raw(prompt_logprobs=True, prompt_logprobs_last_n=len(PROMPT))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
