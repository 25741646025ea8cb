"""Grouped LoRA: several adapters' LoRA products of one linear layer in a fixed number of kernels.

A co-batched pass (cobatch.py) runs each LoRA linear layer's base layer once over every token and
each member's adapter over its own run of tokens. Run one adapter at a time, that is a handful of
kernel launches per member and layer, forward and backward, and a small LoRA product is all launch
cost on a GPU. Here the members' products of one layer are one batched product (as S-LoRA and
punica do, written for this engine):

- the layer input's tokens are gathered into a (P, Lc, in) block, one index op: each member's run
  cut into pieces of at most Lc tokens (Lc the mean run length, so the padding stays below the
  tokens themselves), a piece's padding rows pointing at its own member's last token;
- the members' A (r, in) and B (out, r) are stacked, one per piece, ranks zero-padded to the largest
  (a zero column of A gives a zero column of A x, which meets a zero row of B: exact zeros);
- two ``torch.bmm``, then one multiply by a (P, Lc, 1) tensor holding each piece's member's scaling
  on its tokens and 0 on its padding rows;
- the (P * Lc, out) products are added into the layer's (tokens, out) output at the gathered rows,
  one ``index_add_`` (a padding row adds its 0 to its own member's token).

Stack, pad and the index ops are differentiable, so each member's LoRA parameters get the gradient of
its own tokens' outputs, and a member whose parameters do not require grad (a forward-only member)
gets none. The sums are PEFT's ``lora_B(lora_A(x)) * scaling`` per token, blocked differently
(batched instead of one matrix product per member): equal up to float32 summation order.

The index tensors (``Plan``) depend only on the token layout, the members present and their
scalings, so one plan serves every layer with the same members in a micro-batch: a host-to-device
copy per plan, never per layer. What the batched form does not compute — dropout, DoRA or another
PEFT variant, a LoRA bias, a non-linear LoRA module — makes ``groupable`` say no, and the caller
runs that layer's adapters one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear


@dataclass(frozen=True)
class Plan:
    """Where a layer input's tokens go in the (P, Lc) block of one grouped product.

    ``adapters``: the members present, in token order; ``pieces``: per block row group (piece), the
    index into ``adapters`` of its member; ``rows``: (P * Lc,) token index of each block row (a
    padding row repeats its piece's last token); ``scale``: (P, Lc, 1), the piece's member's scaling
    on its tokens, 0 on padding rows."""

    adapters: tuple[str, ...]
    pieces: tuple[int, ...]
    length: int
    rows: torch.Tensor
    scale: torch.Tensor


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
    )


def groupable(layer: LoraLinear, adapters: list[str]) -> bool:
    """Whether ``adapters``' LoRA on ``layer`` is the plain product the grouped form computes: linear A
    and B without bias, no dropout, no PEFT variant (DoRA, ...), one dtype."""
    dtypes = set()
    for name in adapters:
        a, b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or a.bias is not None or b.bias is not None:
            return False
        if not isinstance(dropout, torch.nn.Identity) and not (isinstance(dropout, torch.nn.Dropout) and dropout.p == 0):
            return False
        if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False):
            return False
        dtypes.add(a.weight.dtype)
        dtypes.add(b.weight.dtype)
    return len(dtypes) == 1


def add_grouped_(layer: LoraLinear, tokens: torch.Tensor, out: torch.Tensor, plan: Plan) -> None:
    """``out[t] += lora_B(lora_A(tokens[t])) * scaling`` for every token t of every member in ``plan``,
    each through its own adapter on ``layer``, as one batched product. ``tokens`` (T, in) is the
    layer's input, ``out`` (T, out) its base output, updated in place."""
    a = [layer.lora_A[name].weight for name in plan.adapters]  # (r, in) each
    b = [layer.lora_B[name].weight for name in plan.adapters]  # (out, r) each
    rank = max(w.shape[0] for w in a)
    a = [w if w.shape[0] == rank else F.pad(w, (0, 0, 0, rank - w.shape[0])) for w in a]
    b = [w if w.shape[1] == rank else F.pad(w, (0, rank - w.shape[1])) for w in b]
    stacked_a = torch.stack([a[k] for k in plan.pieces])  # (P, r, in)
    stacked_b = torch.stack([b[k] for k in plan.pieces])  # (P, out, r)
    x = tokens.index_select(0, plan.rows).to(stacked_a.dtype).view(len(plan.pieces), plan.length, -1)
    y = torch.bmm(torch.bmm(x, stacked_a.transpose(1, 2)), stacked_b.transpose(1, 2)) * plan.scale
    out.index_add_(0, plan.rows, y.view(-1, y.shape[-1]).to(out.dtype))
