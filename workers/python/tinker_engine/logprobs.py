"""Target-token logprobs from logits without a float32 copy of the whole vocabulary.

``target_logprobs(logits, targets)`` equals ``log_softmax(logits.float())`` gathered at
``targets``, but the float32 log-softmax exists one chunk of rows at a time, and autograd keeps
only the logits (already alive) instead of a float32 (N, V) log-softmax. The backward,
``g * (onehot(t) - softmax(x))`` summed over the K targets of a row, recomputes the softmax chunk
by chunk, in float32, and stores the gradient in the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

# Rows per float32 chunk: 1024 rows x 151,936 vocabulary = 0.6 GiB.
CHUNK_ROWS = 1024


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        rows = logits.shape[0]
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk):
            # The fused log-softmax kernel reads the logits' dtype and computes in float32 in one pass;
            # a separate logsumexp is several reduction passes (docs/benchmarks-history.md, H200 second round).
            lp = torch.log_softmax(logits[start : start + chunk], dim=-1, dtype=torch.float32)
            out[start : start + chunk] = lp.gather(-1, targets[start : start + chunk])
        ctx.save_for_backward(logits, targets)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, targets = ctx.saved_tensors
        grad = grad.float()
        out = torch.empty_like(logits)
        chunk = ctx.chunk
        for start in range(0, logits.shape[0], chunk):
            end = start + chunk
            g = grad[start:end]
            # d/dx sum_k g_k log p(t_k) = onehot-sum(g) - p * sum_k g_k, on one float32 chunk in place
            # (the softmax recomputed by the fused kernel); the final copy converts to the logits' dtype.
            part = torch.softmax(logits[start:end], dim=-1, dtype=torch.float32)
            part.mul_(-g.sum(dim=-1, keepdim=True))
            part.scatter_add_(-1, targets[start:end], g)
            out[start:end].copy_(part)
        return out, None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK_ROWS) -> torch.Tensor:
    """log p(targets) (float32, shaped like ``targets``: (N,) or (N, K)) from ``logits`` (N, V)."""
    two_d = targets.dim() == 2
    lp = _TargetLogprobs.apply(logits, targets if two_d else targets.unsqueeze(-1), chunk)
    return lp if two_d else lp.squeeze(-1)
