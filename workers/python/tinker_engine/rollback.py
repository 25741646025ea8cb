"""Non-finite results never stick: the checks and the undo state of the training ops.

``forward_backward`` already keeps a copy of the accumulated gradients (a LoRA adapter's size) and
restores it when the op fails; ``check_losses`` and ``check_grad_max_abs`` make a non-finite loss or
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


def _max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The max-abs (inf) norm of all ``tensors``, on their device: NaN or infinite exactly when one
    element is (it propagates NaN and, unlike the 2-norm, cannot overflow for finite values)."""
    return torch.nn.utils.get_total_norm(tensors, norm_type=float("inf"))


def grad_max_abs(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The accumulated gradient's max-abs, left on the device (0 when no parameter has a gradient)."""
    grads = [p.grad for p in params if p.grad is not None]
    return _max_abs(grads) if grads else torch.zeros(())


def check_grad_max_abs(indices: list[int], max_abs: float) -> None:
    """Raises after backward when the accumulated gradient holds a NaN or infinity."""
    if not math.isfinite(max_abs):
        raise UserError(f"{_datums(indices)}: the gradient is not finite; nothing was applied, "
                        "the model is as before this forward_backward")


def grads_copy(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """A copy of each parameter's gradient (None where it has none), to restore after a failed op."""
    with_grad = [p for p in params if p.grad is not None]
    copies = dict(zip(map(id, with_grad), _copies([p.grad for p in with_grad])))
    return [copies.get(id(p)) for p in params]


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Exact copies of ``tensors``: one flat buffer per device and dtype, filled by one ``cat``, and
    views of it in the tensors' shapes. A LoRA adapter on every linear layer of a 28-layer model has
    ~400 tensors, each with two AdamW moments and a step count: per-tensor clones cost ~40 ms of
    launches per optim_step on a GPU, and even one multi-tensor kernel allocates every output
    separately (~1,600 allocations per step); this is one allocation and one copy per group."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    with torch.no_grad():
        for indices in groups.values():
            parts = [tensors[i].detach().reshape(-1) for i in indices]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            for i, view in zip(indices, flat.split([p.numel() for p in parts])):
                out[i] = view.view(tensors[i].shape)
    return [t for t in out if t is not None]


class StepUndo:
    """What optim_step changes: weights, gradients (clipping scales them) and the AdamW state."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
                 grads_change: bool = True) -> None:
        """``grads_change`` False: the step leaves the gradients as they are (no clipping), so the
        undo keeps the tensors themselves instead of copies."""
        self.params = params
        self.weights = _copies(list(params))
        self.grads = grads_copy(params) if grads_change else [p.grad for p in params]
        self.state: dict[torch.nn.Parameter, dict[str, Any]] = {}
        if optimizer is not None:
            entries = [(p, k, v) for p in params for k, v in (optimizer.state.get(p) or {}).items()]
            tensor_entries = [(p, k, v) for p, k, v in entries if isinstance(v, torch.Tensor)]
            copies = iter(_copies([v for _, _, v in tensor_entries]))
            copied = {(id(p), k): next(copies) for p, k, _ in tensor_entries}
            for p, k, v in entries:
                self.state.setdefault(p, {})[k] = copied.get((id(p), k), v)

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], self.weights)
        for p, g in zip(self.params, self.grads):
            p.grad = g
        for p in self.params:
            if p in self.state:
                optimizer.state[p] = self.state[p]
            else:
                optimizer.state.pop(p, None)


def step_max_abs(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The max-abs of the weights and AdamW moments after a step, left on the device: non-finite
    exactly when the step made one element non-finite."""
    tensors: list[torch.Tensor] = [p.detach() for p in params]
    for p in params:
        tensors += [v for v in optimizer.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
    return _max_abs(tensors)


def check_norm(norm: float) -> None:
    if not math.isfinite(norm):
        raise UserError(f"optim_step: the gradient norm is {norm} (not finite); nothing was applied")
