"""Non-finite results never stick: the checks and the undo state of the training ops.

``forward_backward`` keeps a copy of the accumulated gradients (one flat buffer of the adapter's
size, flat.py) and restores it when the op fails; ``check_losses`` and ``check_grad_max_abs`` make a non-finite loss or
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


def device_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh copies of ``tensors`` in one multi-tensor kernel per device and dtype (exact: x * 1.0
    is x for every float, NaN and infinities included), instead of one ``clone`` launch per tensor:
    a LoRA adapter on every linear layer of a 28-layer model has ~400 tensors. Per-tensor clones and
    one ``cat`` into a flat buffer were both slower on a GPU (docs/benchmarks-history.md, the H200
    rounds two and three)."""
    if not tensors:
        return []
    with torch.no_grad():
        return list(torch._foreach_mul([t.detach() for t in tensors], 1.0))


class UndoBuffers:
    """Snapshot storage kept between optim_steps of one model: a snapshot is one multi-tensor copy
    into the buffers of the last step (same shapes), with no allocation. The first steps (and any
    change of shapes, e.g. when AdamW creates its moments) allocate them."""

    def __init__(self) -> None:
        self._sets: dict[str, list[torch.Tensor]] = {}

    def snapshot(self, key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not tensors:
            return []
        kept = self._sets.get(key)
        same = kept is not None and len(kept) == len(tensors) and all(
            k.shape == t.shape and k.dtype == t.dtype and k.device == t.device for k, t in zip(kept, tensors))
        if not same:
            kept = device_copies(tensors)
            self._sets[key] = kept
            return kept
        assert kept is not None
        with torch.no_grad():
            torch._foreach_copy_(kept, [t.detach() for t in tensors])
        return kept


class StepUndo:
    """What optim_step changes: weights, gradients (clipping scales them) and the AdamW state.

    The snapshot lives in ``buffers`` (reused from step to step); ``restore`` copies it back into
    the live tensors, so the buffers never become live state.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
                 buffers: UndoBuffers, grads_change: bool = True) -> None:
        """``grads_change`` False: the step leaves the gradients as they are (no clipping), so the
        undo copies none."""
        self.params = params
        self.weights = buffers.snapshot("weights", [p.detach() for p in params])
        self.grads_live = [p.grad for p in params]
        with_grad = [g for g in self.grads_live if g is not None]
        self.grads_saved = buffers.snapshot("grads", with_grad) if grads_change else []
        # Per parameter: its state entries before the step (None: it had no state), tensors copied.
        self.had_state: dict[torch.nn.Parameter, dict[str, Any]] = {}
        self.state_live: list[torch.Tensor] = []
        self.state_saved: list[torch.Tensor] = []
        if optimizer is not None:
            for p in params:
                st = optimizer.state.get(p)
                if st:
                    self.had_state[p] = dict(st)
                    self.state_live += [v for v in st.values() if isinstance(v, torch.Tensor)]
            self.state_saved = buffers.snapshot("state", self.state_live)

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], self.weights)
            if self.grads_saved:
                torch._foreach_copy_([g for g in self.grads_live if g is not None], self.grads_saved)
            if self.state_saved:
                torch._foreach_copy_(self.state_live, self.state_saved)
        for p, g in zip(self.params, self.grads_live):
            p.grad = g
        for p in self.params:
            if p in self.had_state:
                optimizer.state[p] = self.had_state[p]
            else:
                optimizer.state.pop(p, None)


def step_max_abs(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The max-abs of the weights and the AdamW state after a step, left on the device: non-finite
    exactly when the step made one element non-finite (read together with the gradient norm, which
    is checked too). The first moment is left out: ``m' = b1*m + (1-b1)*g`` stays within
    ``max(|m|, |g|)``, finite when the gradient is (its norm is) and ``m`` was (checked at the step
    that made it), while ``v' = b2*v + (1-b2)*g^2`` can overflow and the weights can too; a third
    fewer tensors to scan."""
    tensors: list[torch.Tensor] = [p.detach() for p in params]
    for p in params:
        tensors += [v for k, v in optimizer.state.get(p, {}).items()
                    if k != "exp_avg" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
    return _max_abs(tensors)


def check_norm(norm: float) -> None:
    if not math.isfinite(norm):
        raise UserError(f"optim_step: the gradient norm is {norm} (not finite); nothing was applied")
