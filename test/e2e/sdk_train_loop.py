"""A plain Tinker SDK training loop, run unchanged against tinker-broker.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_train_loop.py MODEL {pipelined|sequential} [STEPS]

Trains a LoRA adapter with cross_entropy on a few fixed sequences, then samples from the
saved weights. Prints one JSON object: the per-step mean NLL (from loss_fn_outputs) and
the loss:sum metric, and what sampling returned. Uses nothing but the tinker package.
"""
import json
import sys

import numpy as np
import tinker
from tinker import types

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "12 + 7 = 19 and 30 - 4 = 26.",
    "Tinker runs training loops on your own GPUs.",
    "A small model learns these lines by heart.",
]


def main() -> None:
    model, mode = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=model, rank=8, seed=1234).result()
    tok = tc.get_tokenizer()

    datums = []
    for text in TEXTS:
        ids = tok.encode(text)
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.array(ids[1:], dtype=np.int64),
                    "weights": np.ones(len(ids) - 1, dtype=np.float32),
                },
            )
        )
    n_tokens = sum(len(d.loss_fn_inputs["weights"].data) for d in datums)
    adam = types.AdamParams(learning_rate=2e-2)

    nll, loss_sum, optim_metrics = [], [], []
    for _ in range(steps):
        if mode == "pipelined":
            fb_future = tc.forward_backward(datums, "cross_entropy")
            opt_future = tc.optim_step(adam)
            fb = fb_future.result()
            opt = opt_future.result()
        else:
            fb = tc.forward_backward(datums, "cross_entropy").result()
            opt = tc.optim_step(adam).result()
        lp = np.concatenate([np.asarray(o["logprobs"].data, dtype=np.float64) for o in fb.loss_fn_outputs])
        assert lp.shape == (n_tokens,), lp.shape
        nll.append(float(-lp.sum() / n_tokens))
        loss_sum.append(float(fb.metrics["loss:sum"]))
        optim_metrics.append(opt.metrics or {})

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("The quick brown"))
    res = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result()
    greedy = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0)).result()
    # The sampled tokens' logprobs, recomputed by scoring prompt + completion.
    g = greedy.sequences[0]
    rescored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + list(g.tokens))).result()
    print(
        json.dumps(
            {
                "model_id": tc.model_id,
                "nll": nll,
                "loss_sum": loss_sum,
                "n_tokens": n_tokens,
                "optim_metrics": optim_metrics[-1],
                "samples": [
                    {"tokens": list(s.tokens), "logprobs": list(s.logprobs or []), "stop_reason": s.stop_reason}
                    for s in res.sequences
                ],
                "greedy": {
                    "tokens": list(g.tokens),
                    "logprobs": list(g.logprobs or []),
                    "rescored": list(rescored[-len(g.tokens):]),
                    "text": tok.decode(g.tokens),
                },
                "base_model": sampler.get_base_model(),
            }
        )
    )


if __name__ == "__main__":
    main()
