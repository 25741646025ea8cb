"""Target-token logprobs from logits without a float32 copy of the whole vocabulary.

``target_logprobs(logits, targets)`` equals ``log_softmax(logits.float())`` gathered at
``targets`` (up to float32 rounding: ``x[t] - logsumexp(x)``), but float32 work happens in chunks
of rows, and autograd keeps only the logits (already alive) and one float32 logsumexp per row
instead of a float32 (N, V) log-softmax. The backward, ``g * (onehot(t) - softmax(x))`` summed
over the K targets of a row, is computed chunk by chunk as well, in float32, and stored in the
logits' dtype.
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
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk):
            lse[start : start + chunk] = torch.logsumexp(logits[start : start + chunk].float(), dim=-1)
        picked = logits.gather(-1, targets).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return picked - lse.unsqueeze(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        grad = grad.float()
        out = torch.empty_like(logits)
        chunk = ctx.chunk
        for start in range(0, logits.shape[0], chunk):
            end = start + chunk
            g = grad[start:end]
            # In place on one float32 chunk (each pass over it is ~0.6 GiB of memory traffic);
            # the final copy converts to the logits' dtype.
            part = logits[start:end].to(torch.float32, copy=True)  # never the saved logits themselves
            part.sub_(lse[start:end].unsqueeze(-1)).exp_()
            part.mul_(-g.sum(dim=-1, keepdim=True))
            part.scatter_add_(-1, targets[start:end], g)
            out[start:end].copy_(part)
        return out, None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK_ROWS) -> torch.Tensor:
    """log p(targets) (float32, shaped like ``targets``: (N,) or (N, K)) from ``logits`` (N, V)."""
    two_d = targets.dim() == 2
    lp = _TargetLogprobs.apply(logits, targets if two_d else targets.unsqueeze(-1), chunk)
    return lp if two_d else lp.squeeze(-1)
