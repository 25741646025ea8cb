"""Builders for protocol payloads and direct access to an engine's adapter parameters."""

from __future__ import annotations

from typing import Any

import torch

from tinker_engine.engine import Engine
from tinker_engine.tensors import tensor_to_json

BASE = "tiny"
ALL_TARGETS = {"train_unembed": True, "train_mlp": True, "train_attn": True}


def lora(rank: int = 4, seed: int | None = 0, **flags: bool) -> dict[str, Any]:
    return {"rank": rank, "seed": seed, **{**ALL_TARGETS, **flags}}


def create(engine: Engine, model_id: str, rank: int = 4, seed: int | None = 0, **flags: bool) -> None:
    engine.call("create_model", {"model_id": model_id, "base_model": BASE, "lora": lora(rank, seed, **flags)})


def perturb(engine: Engine, model_id: str, seed: int = 1, scale: float = 0.05) -> None:
    """Give every LoRA matrix (B too) random values, so no gradient is trivially zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in engine.registry.model(model_id).params:
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def params(engine: Engine, model_id: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.registry.model(model_id).params}


def grads(engine: Engine, model_id: str) -> dict[str, torch.Tensor | None]:
    """Each LoRA parameter's accumulated gradient; None when nothing has been accumulated since the
    last step (a backward run by a test directly, outside forward_backward, counts too)."""
    m = engine.registry.model(model_id)
    present = m.flat.pending or bool(m.flat.grad.any())
    return {n: p.grad.clone() if present else None for n, p in m.params}


def zero_grads(engine: Engine, model_id: str) -> None:
    engine.registry.model(model_id).flat.zero_grad()


def datum(tokens: list[int], targets: torch.Tensor, **inputs: torch.Tensor) -> dict[str, Any]:
    loss_inputs = {"target_tokens": tensor_to_json(targets.to(torch.int64))}
    loss_inputs.update({k: tensor_to_json(v.to(torch.float32)) for k, v in inputs.items()})
    return {"tokens": tokens, "loss_fn_inputs": loss_inputs}


def fb(engine: Engine, model_id: str, loss_fn: str, data: list[dict[str, Any]],
       config: dict[str, Any] | None = None, forward_only: bool = False) -> dict[str, Any]:
    return engine.call("forward_backward", {"model_id": model_id, "loss_fn": loss_fn,
                                            "loss_fn_config": config or {}, "forward_only": forward_only,
                                            "data": data})


def out_logprobs(result: dict[str, Any], i: int) -> torch.Tensor:
    t = result["loss_fn_outputs"][i]["logprobs"]
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32  # the channel sends it as binary
    return t


def adam(lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8,
         weight_decay: float = 0.0, grad_clip_norm: float = 0.0) -> dict[str, float]:
    return {"learning_rate": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
            "weight_decay": weight_decay, "grad_clip_norm": grad_clip_norm}


def sampling(max_tokens: int = 8, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
             seed: int | None = 0, stop_tokens: list[int] | None = None,
             stop_strings: list[str] | None = None, stop_at_eos: bool = True) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "seed": seed, "stop_tokens": stop_tokens or [], "stop_strings": stop_strings or [],
            "stop_at_eos": stop_at_eos}


def sample(engine: Engine, prompt: list[int], params: dict[str, Any], num_samples: int = 1,
           adapter_dir: str | None = None, prompt_logprobs: bool = False, topk: int = 0) -> dict[str, Any]:
    return engine.call("sample", {"base_model": BASE, "adapter_dir": adapter_dir, "prompt": prompt,
                                  "num_samples": num_samples, "sampling_params": params,
                                  "prompt_logprobs": prompt_logprobs, "topk_prompt_logprobs": topk})


# Unit roundoff of float32 (2**-24).
FP32_U = 2.0**-24
# Two float32 computations of the same quantity that differ only in summation order (split vs
# joint batches, micro-batches, the thread count of a blocked matmul) each carry a rounding error
# of up to gamma_n * sum|terms| ~ n*u*sum|terms| for a reduction of length n, and typically
# ~sqrt(n)*u. A LoRA gradient here chains reductions over the hidden size (<= 128) and the tokens
# (~14) through two layers, so the error scales with the tensor's magnitude, not with the element's:
# a near-cancelling element can be off by far more than 1e-6 in absolute terms. We allow 256*u
# (~1.5e-5) of the tensor's largest magnitude (observed: ~20*u with 2-4 threads); a real mistake
# (a datum dropped, doubled or mis-weighted) moves gradients by O(1) relative, far above this.
ORDER_SLACK = 256 * FP32_U


def assert_close_up_to_summation_order(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=ORDER_SLACK, atol=ORDER_SLACK * scale,
                               msg=lambda m: f"{what}: {m}" if what else m)
