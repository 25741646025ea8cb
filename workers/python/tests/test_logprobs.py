"""Chunked target logprobs: same values and gradients as float32 log-softmax, any chunking."""

from __future__ import annotations

import pytest
import torch

from tinker_engine.logprobs import target_logprobs


def reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets if targets.dim() == 2 else targets.unsqueeze(-1)).reshape(targets.shape)


@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("chunk", [1, 4, 7, 1024])
def test_matches_log_softmax_float32(k: int | None, chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn((13, 50), generator=gen) * 3).requires_grad_(True)
    shape = (13,) if k is None else (13, k)
    targets = torch.randint(0, 50, shape, generator=gen)
    weights = torch.randn(shape, generator=gen)
    ours = target_logprobs(logits, targets, chunk=chunk)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    ref = reference(logits, targets)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    # x[t] - logsumexp(x) vs log_softmax: a few float32 roundings of values of magnitude ~10.
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)
    assert ours.dtype == torch.float32 and ours.shape == targets.shape


def test_bfloat16_logits_get_float32_logprobs_and_bfloat16_gradients() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn((9, 40), generator=gen).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 40, (9,), generator=gen)
    ours = target_logprobs(logits, targets, chunk=4)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference(logits, targets), rtol=0, atol=1e-5)
    (grad,) = torch.autograd.grad(ours.sum(), logits)
    (g_ref,) = torch.autograd.grad(reference(logits, targets).sum(), logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), g_ref.float(), rtol=1e-2, atol=1e-2)  # bf16 storage: 8 mantissa bits
