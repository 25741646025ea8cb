"""Grouped LoRA: several adapters' LoRA products of one linear layer in a fixed number of kernels.

A co-batched pass (cobatch.py) runs each LoRA linear layer's base layer once over every token and
each member's adapter over its own run of tokens. Run one adapter at a time, that is a handful of
kernel launches per member and layer, forward and backward, and a small LoRA product is all launch
cost on a GPU. Here the members' products of one layer are one batched product (as S-LoRA and
punica do, written for this engine):

- the layer input's tokens are gathered into a (P, Lc, in) block, one index op: each member's run
  cut into pieces of at most Lc tokens (Lc the mean run length, so the padding stays below the
  tokens themselves), a piece's padding rows pointing at its own member's last token (so that
  0 x inf on a padding row stays within the member whose activation is not finite);
- the members' A (r, in) and B (out, r) are stacked, one per piece, ranks zero-padded to the largest
  (a zero column of A gives a zero column of A x, which meets a zero row of B: exact zeros);
- two ``torch.bmm``, then one multiply by a (P, Lc, 1) tensor holding each piece's member's scaling
  on its tokens and 0 on its padding rows;
- the (P * Lc, out) products are added into the layer's (tokens, out) output at the gathered rows,
  one ``index_add_`` (a padding row adds its 0 to its own member's token).

Each member's LoRA parameters get the gradient of its own tokens' outputs, and a member whose
parameters do not require grad (a forward-only member) gets none: the gradient autograd would give
through the stack and the padding, which the backward (``_Product``) adds into each member's ``.grad``
itself, with one multi-tensor add for all members instead of an accumulation per parameter (where a
parameter has no ``.grad`` yet, autograd does it through the stack). The sums are PEFT's
``lora_B(lora_A(x)) * scaling`` per token, blocked differently (batched instead of one matrix product
per member): equal up to float32 summation order.

The index tensors (``Plan``) depend only on the token layout, the members present and their
scalings, so one plan serves every layer with the same members in a micro-batch: a host-to-device
copy per plan, never per layer. What the batched form does not compute — dropout, DoRA or another
PEFT variant, a LoRA bias, a non-linear LoRA module — makes ``plain_weights`` say no, and the caller
runs that layer's adapters one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear


@dataclass(frozen=True)
class Plan:
    """Where a layer input's tokens go in the (P, Lc) block of one grouped product.

    ``adapters``: the members present, in token order; ``pieces``: per block row group (piece), the
    index into ``adapters`` of its member; ``rows``: (P * Lc,) token index of each block row (a
    padding row repeats its piece's last token); ``scale``: (P, Lc, 1), the piece's member's scaling
    on its tokens, 0 on padding rows; ``owners``: ``pieces`` on the device."""

    adapters: tuple[str, ...]
    pieces: tuple[int, ...]
    length: int
    rows: torch.Tensor
    scale: torch.Tensor
    owners: torch.Tensor
    # Per tuple of the members' ranks, when they differ: ``_stacks``'s index of the padded stacks.
    rank_rows: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)


def make_plan(runs: list[tuple[str, int, int]], scalings: list[float], device: torch.device,
              dtype: torch.dtype) -> Plan:
    """The plan for ``runs``: (adapter, first token, token after the last) of each member present,
    in the layer input's token coordinates, one run per member; ``scalings`` per run."""
    if not runs or any(end <= first for _, first, end in runs):
        raise ValueError("every run must hold at least one token")
    total = sum(end - first for _, first, end in runs)
    length = -(-total // len(runs))
    pieces: list[int] = []
    rows: list[torch.Tensor] = []
    scale: list[torch.Tensor] = []
    steps = torch.arange(length)
    for k, ((_, first, end), scaling) in enumerate(zip(runs, scalings)):
        for start in range(first, end, length):
            n = min(length, end - start)
            pieces.append(k)
            rows.append(start + steps.clamp(max=n - 1))
            scale.append(torch.where(steps < n, scaling, 0.0))
    return Plan(
        adapters=tuple(name for name, _, _ in runs),
        pieces=tuple(pieces),
        length=length,
        rows=torch.cat(rows).to(device),
        scale=torch.stack(scale).to(device=device, dtype=dtype).unsqueeze(-1),
        owners=torch.tensor(pieces, device=device),
    )


Weights = tuple[list[torch.Tensor], list[torch.Tensor]]


def plain_weights(layer: LoraLinear, adapters: list[str]) -> Weights | None:
    """``adapters``' A (r, in) and B (out, r) weights on ``layer`` when their LoRA is the plain product
    the grouped form computes: linear A and B without bias, no dropout, no PEFT variant (DoRA, ...),
    one dtype; else None. (Per layer and pass: module attribute reads are hoisted, they cost.)"""
    lora_a, lora_b, dropouts = layer.lora_A, layer.lora_B, layer.lora_dropout
    variants, dora, bias = getattr(layer, "lora_variant", {}), getattr(layer, "use_dora", {}), getattr(layer, "lora_bias", {})
    a: list[torch.Tensor] = []
    b: list[torch.Tensor] = []
    for name in adapters:
        module_a, module_b, dropout = lora_a[name], lora_b[name], dropouts[name]
        if type(module_a) is not torch.nn.Linear or type(module_b) is not torch.nn.Linear:
            return None
        if type(dropout) is not torch.nn.Identity and not (type(dropout) is torch.nn.Dropout and dropout.p == 0):
            return None
        if name in variants or dora.get(name, False) or bias.get(name, False):
            return None
        a.append(module_a.weight)
        b.append(module_b.weight)
    if any(w.dtype != a[0].dtype for w in a + b):
        return None
    return a, b


def add_grouped_(weights: Weights, tokens: torch.Tensor, out: torch.Tensor, plan: Plan) -> None:
    """``out[t] += B @ A @ tokens[t] * scaling`` for every token t of every member in ``plan``, each
    with its own adapter's ``weights`` (``plain_weights``, in ``plan.adapters`` order), as one batched
    product. ``tokens`` (T, in) is the layer's input, ``out`` (T, out) its base output, updated in place."""
    a, b = weights
    x = tokens.index_select(0, plan.rows).to(a[0].dtype).view(len(plan.pieces), plan.length, -1)
    trained = [w for w in a + b if w.requires_grad]
    if torch.is_grad_enabled() and trained and all(w.grad is not None for w in trained):
        y = _Product.apply(x, trained[0], plan, a, b)
    else:
        y = _product(x, _stack_a(plan, a), _stack_b(plan, b), plan.scale)
    out.index_add_(0, plan.rows, y.view(-1, y.shape[-1]).to(out.dtype))


def _stack_a(plan: Plan, a: list[torch.Tensor]) -> torch.Tensor:
    """(P, r, in): each piece's member's A, its rank zero-padded to the largest."""
    rank = max(w.shape[0] for w in a)
    a = [w if w.shape[0] == rank else F.pad(w, (0, 0, 0, rank - w.shape[0])) for w in a]
    return torch.stack([a[k] for k in plan.pieces])


def _stack_b(plan: Plan, b: list[torch.Tensor]) -> torch.Tensor:
    """(P, out, r): each piece's member's B, its rank zero-padded to the largest."""
    rank = max(w.shape[1] for w in b)
    b = [w if w.shape[1] == rank else F.pad(w, (0, rank - w.shape[1])) for w in b]
    return torch.stack([b[k] for k in plan.pieces])


def _product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2)) * scale


def _stacks(plan: Plan, a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``_stack_a`` and ``_stack_b`` outside autograd, in a fixed number of kernels whatever the
    members: where the ranks differ, every member's A rows (B columns) and a zero row (column) are
    concatenated and the padded stacks gathered from them with one index (made once per plan and
    ranks), instead of a pad per member."""
    ranks = tuple(w.shape[0] for w in a)
    if len(set(ranks)) == 1:
        return torch.stack([a[k] for k in plan.pieces]), torch.stack([b[k] for k in plan.pieces])
    rank = max(ranks)
    index = plan.rank_rows.get(ranks)
    if index is None:
        starts = [sum(ranks[:k]) for k in range(len(ranks))]
        zero = sum(ranks)
        index = plan.rank_rows[ranks] = torch.tensor(
            [starts[k] + j if j < ranks[k] else zero for k in plan.pieces for j in range(rank)], device=plan.rows.device)
    pieces = len(plan.pieces)
    stacked_a = torch.cat([*a, a[0].new_zeros(1, a[0].shape[1])]).index_select(0, index).view(pieces, rank, -1)
    stacked_b = torch.cat([*b, b[0].new_zeros(b[0].shape[0], 1)], dim=1).index_select(1, index)
    return stacked_a, stacked_b.view(-1, pieces, rank).transpose(0, 1)


class _Product(torch.autograd.Function):
    """``_product`` of the stacked weights, whose backward adds each member's weight gradients into
    its parameters' ``.grad`` (the adapter's flat gradient buffer, flat.py) with two ``_foreach_add_``
    (a launch or a few for all members) instead of autograd's accumulation, a launch per parameter.
    That is what autograd would do with the stack: the gradient of a stacked weight is its member's
    slice of the stack's gradient, summed over the member's pieces, its zero padding dropped; a member
    whose parameters do not require grad gets none. ``anchor`` (a parameter that requires grad) is an
    input only so that the output requires grad where ``x`` does not (the first layer's input); it
    gets no gradient through here."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, plan: Plan,  # type: ignore[override]
                a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            stacked_a, stacked_b = _stacks(plan, a, b)
            h = torch.bmm(x, stacked_a.transpose(1, 2))
            y = torch.bmm(h, stacked_b.transpose(1, 2)).mul_(plan.scale)  # in place: the output layer's y is large
        # The stacks are made again in the backward (two copies) rather than kept: kept for every layer,
        # they would hold a copy of every member's whole adapter until the backward.
        ctx.save_for_backward(x, h)
        ctx.plan, ctx.a, ctx.b = plan, a, b
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, h = ctx.saved_tensors
        plan: Plan = ctx.plan
        with torch.no_grad():
            stacked_a, stacked_b = _stacks(plan, ctx.a, ctx.b)
        g = grad * plan.scale  # (P, Lc, out)
        gh = torch.bmm(g, stacked_b)  # (P, Lc, r)
        grad_b = torch.bmm(g.transpose(1, 2), h)  # (P, out, r)
        grad_a = torch.bmm(gh.transpose(1, 2), x)  # (P, r, in)
        if len(plan.pieces) > len(plan.adapters):  # a member's pieces: one sum per member
            grad_a = grad_a.new_zeros((len(plan.adapters), *grad_a.shape[1:])).index_add_(0, plan.owners, grad_a)
            grad_b = grad_b.new_zeros((len(plan.adapters), *grad_b.shape[1:])).index_add_(0, plan.owners, grad_b)
        # Member k's A (r_k, in) and B (out, r_k): its slices of the gradients, the rank padding cut off.
        grads_a, grads_b = grad_a.unbind(0), grad_b.unbind(0)
        ranks = [w.shape[0] for w in ctx.a]
        if min(ranks) < grad_a.shape[1]:
            grads_a = tuple(g[:r] for g, r in zip(grads_a, ranks))
            grads_b = tuple(g[:, :r] for g, r in zip(grads_b, ranks))
        for params, grads in ((ctx.a, grads_a), (ctx.b, grads_b)):
            pairs = [(p.grad, g) for p, g in zip(params, grads) if p.requires_grad]
            if pairs:
                torch._foreach_add_([p for p, _ in pairs], [g for _, g in pairs])
        grad_x = torch.bmm(gh, stacked_a) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None
