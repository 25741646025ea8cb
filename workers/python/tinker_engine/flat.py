"""A training adapter's weights, gradients and AdamW moments, each one flat float32 buffer.

A LoRA adapter on every linear layer of a 28-layer model is ~400 tensors. What ``optim_step`` does
to them (the gradient norm, AdamW, the undo snapshot, the finiteness check) costs Python work and
kernel launches per tensor, or per chunk of tensors, when they are separate tensors; and that host
time is not hidden behind GPU work, since forward_backward ends with a host copy and the GPU idles
while optim_step issues its launches. Here every LoRA parameter's ``.data`` is a view of one flat
weight buffer and its ``.grad`` a view of one flat gradient buffer, so each of those is one op on
one tensor, and the optimizer steps one parameter.

Why the numbers do not change:
- autograd accumulates into an existing ``.grad`` in place (``grad += new``), so backward writes
  into the flat gradient buffer; ``0 + g`` is ``g`` exactly, so the first accumulation equals the
  gradient a fresh ``.grad`` would get;
- AdamW is elementwise: stepping the flat buffer gives every element exactly what stepping the
  tensors one by one gives;
- the gradient norm is one reduction over all elements instead of the norm of per-tensor norms: a
  different float32 summation order, equal within float32 rounding (relative ~1e-7 per term).

Gradients are "pending" from the first forward_backward after a step (or a fresh model) until the
next optim_step; while none are pending the buffer holds zeros and ``optim_step`` leaves the model
and the AdamW state as they are, as an optimizer over parameters without gradients would.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UserError

MOMENTS = ("exp_avg", "exp_avg_sq")


class FlatAdapter:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        if not params:
            raise ValueError("a flat adapter needs parameters")
        device = params[0].device
        for p in params:
            if p.dtype != torch.float32 or p.device != device:
                raise ValueError(f"flat adapter parameters must be float32 on {device}, got {p.dtype} on {p.device}")
        self.params = params
        self.shapes = [p.shape for p in params]
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        # The optimizer's one parameter; never used in a graph (the LoRA parameters are).
        self.weight = torch.nn.Parameter(torch.empty(total, dtype=torch.float32, device=device))
        self.grad = torch.zeros(total, dtype=torch.float32, device=device)
        self.weight.grad = self.grad
        self.pending = False
        with torch.no_grad():
            for p, view in zip(params, self.views(self.weight.detach())):
                view.copy_(p.detach())
                p.data = view
        self.attach_grads()

    def attach_grads(self) -> None:
        """Zero gradients, each parameter's ``.grad`` a view of the flat buffer again (after code
        outside the engine, e.g. a benchmark's plain optimizer, set them to None)."""
        self.grad.zero_()
        self.pending = False
        for p, view in zip(self.params, self.views(self.grad)):
            p.grad = view

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per LoRA parameter, its part of ``flat`` (a buffer of the adapter's size) in its shape."""
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One flat float32 buffer on the adapter's device holding ``tensors`` (one per parameter)."""
        out = torch.empty_like(self.grad)
        with torch.no_grad():
            for view, t in zip(self.views(out), tensors):
                view.copy_(t.reshape(view.shape))
        return out

    def zero_grad(self) -> None:
        self.grad.zero_()
        self.pending = False

    def grads_saved(self) -> torch.Tensor | None:
        """What ``restore_grads`` needs to undo a failed forward_backward (None: zeros)."""
        return self.grad.clone() if self.pending else None

    def restore_grads(self, saved: torch.Tensor | None) -> None:
        if saved is None:
            self.zero_grad()
        else:
            with torch.no_grad():
                self.grad.copy_(saved)

    def set_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Loaded gradients, one per parameter (None: zero); pending when any is given."""
        self.grad.zero_()
        with torch.no_grad():
            for view, g in zip(self.views(self.grad), grads):
                if g is not None:
                    view.copy_(g)
        self.pending = any(g is not None for g in grads)

    def param_states(self, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
        """Per LoRA parameter, its AdamW state as separate tensors would have it (``step`` and views
        of the moments); empty dicts before the first step."""
        state = {} if optimizer is None else optimizer.state.get(self.weight, {})
        if not state:
            return [{} for _ in self.params]
        unexpected = set(state) - {"step", *MOMENTS}
        if unexpected:
            raise RuntimeError(f"unsupported AdamW state entries {sorted(unexpected)}")
        moments = {m: self.views(state[m]) for m in MOMENTS}
        return [{"step": state["step"], **{m: moments[m][i] for m in MOMENTS}} for i in range(len(self.params))]

    def optimizer(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                  state: list[tuple[float, dict[str, torch.Tensor]] | None] | None = None) -> torch.optim.AdamW:
        """An AdamW over the flat weights (fused on CUDA: one launch), holding ``state`` when given:
        per parameter (step, moments) from a checkpoint. The whole adapter steps together, so every
        parameter must have state and all the same step count."""
        opt = torch.optim.AdamW([self.weight], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                fused=self.weight.is_cuda or None)
        if state is None or all(s is None for s in state):
            return opt
        steps = {None if s is None else s[0] for s in state}
        if None in steps or len(steps) != 1:
            raise UserError("load_state: the checkpoint's AdamW state covers only some parameters or has different "
                            "step counts per parameter; this engine steps the whole adapter together")
        (step,) = steps
        full = [s for s in state if s is not None]
        loaded = {m: self.flatten([moments[m] for _, moments in full]) for m in MOMENTS}
        state_dict = opt.state_dict()
        state_dict["state"] = {0: {"step": torch.tensor(step, dtype=torch.float32), **loaded}}
        opt.load_state_dict(state_dict)
        return opt
