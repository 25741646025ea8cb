"""Server-side custom losses through the SDK: one loss, run on the server and on the client.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_custom_loss.py MODEL OTHER_KEY
Two twin models (same LoRA seed). ``create_custom_loss`` uploads the traced loss (the server says
``custom_loss_server_side``); twin A runs it with ``forward_backward_custom(data, handle)`` (one
server-side forward_backward), twin B with the same handle minus its ``loss_id``, which the SDK runs
client-side (a forward, the loss on its logprobs, a cross_entropy backward with weights -dC/dlp).
Then one identical AdamW step on each and the same loss again; then a loss with rank-0 (scalar) inputs
the same way, one step. A scalar for a built-in loss and a request past the scalar cap are refused. A
client of another API key tries the loss id. Prints one JSON object.
"""
import dataclasses
import json
import sys

import tinker
import torch
from tinker import types

from sdk_common import error_of


def ppo_like(logprobs, old, adv):
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * adv, clipped * adv).sum() + 0.01 * (logprobs ** 2).mean()
    return loss, {"custom/entropy:mean": -(logprobs.exp() * logprobs).sum(),
                  "custom/clipped:sum": (ratio != clipped).float().sum()}


def per_sequence(logprobs, old, adv, group):
    """Rank-0 inputs: one advantage (float32) and one group size (int64) per datum."""
    ratio = torch.exp(logprobs - old)
    loss = -(ratio * adv).sum() / group + 0.01 * (logprobs ** 2).mean()
    return loss, {"custom/adv:mean": adv * 1.0, "custom/group:sum": group.float() + ratio.sum() * 0}


def scalar_data() -> list[types.Datum]:
    """Datums whose adv and group are 0-d tensors (the SDK sends them with shape []), a one-token one among them."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for j, n in enumerate((8, 1, 5)):
        tokens = torch.randint(5, 200, (n + 1,), generator=gen).tolist()
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                "old": -4.0 - torch.rand(n, generator=gen),
                "adv": torch.randn((), generator=gen),
                "group": torch.tensor(j + 2),
            },
        ))
    return out


def data() -> list[types.Datum]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (9, 6, 12):
        tokens = torch.randint(5, 200, (n + 1,), generator=gen).tolist()
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                "old": types.TensorData(data=(-4.0 - torch.rand(n, generator=gen)).tolist(), dtype="float32", shape=[n]),
                "adv": types.TensorData(data=torch.randn(n, generator=gen).tolist(), dtype="float32", shape=[n]),
                # Not read by the loss: the SDK sends a datum's inputs unchanged; the server drops it.
                "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
            },
        ))
    return out


def logprobs_of(result: types.ForwardBackwardOutput) -> list[list[float]]:
    return [list(map(float, o["logprobs"].data)) for o in result.loss_fn_outputs]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def main() -> None:
    model, other_key = sys.argv[1], sys.argv[2]
    svc = tinker.ServiceClient()
    out: dict[str, object] = {"server_side": svc.holder.get_client_config().custom_loss_server_side}
    handle = svc.create_custom_loss(ppo_like, {"logprobs": 1, "old": 1, "adv": 1}).result()
    local = dataclasses.replace(handle, loss_id=None)
    out["loss_id"] = handle.loss_id
    a = svc.create_lora_training_client(base_model=model, rank=4, seed=11).result()
    b = svc.create_lora_training_client(base_model=model, rank=4, seed=11).result()
    batch = data()
    adam = types.AdamParams(learning_rate=2e-2)
    steps = []
    for _ in range(2):
        ra = a.forward_backward_custom(batch, handle).result()
        rb = b.forward_backward_custom(batch, local).result()
        ga = a.optim_step(adam).result().metrics["grad_norm"]
        gb = b.optim_step(adam).result().metrics["grad_norm"]
        steps.append({"server": ra.metrics, "client": rb.metrics, "logprob_diff": max_diff(logprobs_of(ra), logprobs_of(rb)),
                      "grad_norm": [ga, gb]})
    out["steps"] = steps
    # After two steps each, the same plain forward on both twins.
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in batch]
    fa = a.forward(plain, "cross_entropy").result()
    fb = b.forward(plain, "cross_entropy").result()
    out["after_logprob_diff"] = max_diff(logprobs_of(fa), logprobs_of(fb))
    # A loss with rank-0 inputs, server-side on twin A and client-side on twin B, then one step each.
    scalar = svc.create_custom_loss(per_sequence, {"logprobs": 1, "old": 1, "adv": 0, "group": 0}).result()
    sbatch = scalar_data()
    ra = a.forward_backward_custom(sbatch, scalar).result()
    rb = b.forward_backward_custom(sbatch, dataclasses.replace(scalar, loss_id=None)).result()
    ga = a.optim_step(adam).result().metrics["grad_norm"]
    gb = b.optim_step(adam).result().metrics["grad_norm"]
    out["scalar_loss_id"] = scalar.loss_id
    out["scalar_step"] = {"server": ra.metrics, "client": rb.metrics, "logprob_diff": max_diff(logprobs_of(ra), logprobs_of(rb)),
                          "grad_norm": [ga, gb]}
    # A scalar where a built-in loss needs a per-token tensor: refused.
    n = len(batch[0].loss_fn_inputs["target_tokens"].data)
    plain = [types.Datum(model_input=batch[0].model_input,
                         loss_fn_inputs={"target_tokens": batch[0].loss_fn_inputs["target_tokens"],
                                         "logprobs": torch.full((n,), -3.0), "advantages": torch.tensor(1.0)})]
    out["plain_scalar_error"] = error_of(lambda: a.forward_backward(plain, "importance_sampling").result())
    # One request of the SDK's default chunk (1024 datums) with 17 scalars each: past the cap of 16384.
    many = [types.Datum(model_input=types.ModelInput.from_ints([7, 8]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[8, 9], dtype="int64", shape=[2]),
                                        **{f"s{k}": torch.tensor(float(k)) for k in range(17)}}) for _ in range(1024)]
    out["past_cap_error"] = error_of(lambda: a.forward_backward(many, "custom", {"loss_id": scalar.loss_id}).result())
    # A datum without an input the loss reads: refused before it is queued, naming the input.
    short = [types.Datum(model_input=batch[0].model_input,
                         loss_fn_inputs={k: v for k, v in batch[0].loss_fn_inputs.items() if k != "adv"})]
    out["missing_input_error"] = error_of(lambda: a.forward_backward(short, "custom", {"loss_id": handle.loss_id}).result())
    # Another API key (tenant) cannot run it.
    other = tinker.ServiceClient(api_key=other_key)
    tc = other.create_lora_training_client(base_model=model, rank=4, seed=11).result()
    out["other_tenant_error"] = error_of(lambda: tc.forward_backward(batch, "custom", {"loss_id": handle.loss_id}).result())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
