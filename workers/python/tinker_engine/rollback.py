"""Non-finite results never stick: the checks and the undo state of the training ops.

``forward_backward`` already keeps a copy of the accumulated gradients (a LoRA adapter's size) and
restores it when the op fails; ``check_losses`` and ``check_grads`` make a non-finite loss or
gradient such a failure, a ``UserError`` naming the datums. ``optim_step`` takes a ``StepUndo``
(weights, gradients and AdamW moments of the adapter: a few copies of a LoRA adapter, no base
weights) before it steps, and restores it when the step would leave a non-finite weight or moment.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import UserError


def _datums(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"datum {indices[0]}"
    return f"datums {indices[0]}..{indices[-1]}"


def check_losses(indices: list[int], losses: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    """Raises before backward when a datum's loss or target logprobs are NaN or infinite."""
    for i, loss, lp in zip(indices, losses, outputs):
        if not bool(torch.isfinite(loss.detach()).all()):
            raise UserError(f"datum {i}: the loss is {float(loss.detach())} (not finite); nothing was applied, "
                            "the model is as before this forward_backward (check logprobs/advantages for extreme values)")
        if not bool(torch.isfinite(lp).all()):
            raise UserError(f"datum {i}: a target logprob is not finite; nothing was applied, "
                            "the model is as before this forward_backward")


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite, with one host sync: the max-abs (inf) norm
    propagates NaN and infinity and, unlike the 2-norm, cannot overflow for finite values."""
    if not tensors:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, norm_type=float("inf"))))


def check_grads(indices: list[int], params: list[torch.nn.Parameter]) -> None:
    """Raises after backward when the accumulated gradient holds a NaN or infinity."""
    if not _all_finite([p.grad for p in params if p.grad is not None]):
        raise UserError(f"{_datums(indices)}: the gradient is not finite; nothing was applied, "
                        "the model is as before this forward_backward")


class StepUndo:
    """What optim_step changes: weights, gradients (clipping scales them) and the AdamW state."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> None:
        self.params = params
        self.weights = [p.detach().clone() for p in params]
        self.grads = [None if p.grad is None else p.grad.clone() for p in params]
        self.state: dict[torch.nn.Parameter, dict[str, Any]] = {}
        if optimizer is not None:
            for p in params:
                st = optimizer.state.get(p)
                if st:
                    self.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, w, g in zip(self.params, self.weights, self.grads):
                p.copy_(w)
                p.grad = g
        for p in self.params:
            if p in self.state:
                optimizer.state[p] = self.state[p]
            else:
                optimizer.state.pop(p, None)


def step_is_finite(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> bool:
    tensors: list[torch.Tensor] = [p.detach() for p in params]
    for p in params:
        tensors += [v for v in optimizer.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
    return _all_finite(tensors)


def check_norm(norm: float) -> None:
    if not math.isfinite(norm):
        raise UserError(f"optim_step: the gradient norm is {norm} (not finite); nothing was applied")
