"""``forward_backward_group``: the forward_backward ops of several models on one base model, run as
one pass of the base ("co-batching", docs/architecture.md).

Each member is a forward_backward request of its own model (its datums, its loss function and
config, its forward-only flag). Their datums are grouped together into micro-batches as one request's
are (packing.py: packed into one row where the attention kernel isolates datums, else padded:
``group_layout``), one member's after another; each datum's tokens go
through its own model's LoRA adapter (``_token_segments``: the base's linear layers run once over
every token, and the adapters of a layer's members as one grouped product over their tokens,
grouped_lora.py).
Ranks, target modules and loss functions may differ between the members.

Why each member gets what it would get alone:
- datums never mix in a decoder (attention is causal and kept within each datum, per row when padded,
  per datum of a packed row; normalisation is per token), so a datum's logits depend only on its
  tokens and its adapter; a row right-padded further (the longest row is another member's) keeps its
  real positions' outputs;
- the pass backpropagates the sum of every trainable member's loss: a member's LoRA parameters
  appear only in its own rows, so their gradient is the gradient of its own loss, accumulated into
  its own flat buffer (flat.py), as forward_backward accumulates it;
- what differs is float32 rounding only: the base's matrix products run over more tokens (another
  blocking of the same sums) and an adapter's over its tokens gathered from the micro-batch, batched
  with the other members' (bmm instead of mm, ranks zero-padded: exact zeros). tests/test_cobatch.py
  bounds the difference.

A member whose request is invalid (a UserError while parsing: bad datum, unknown model) or whose
loss or gradient is not finite fails alone, its gradients restored to what they were before; the
others go on. Any other failure (out of memory) restores every member's gradients and fails the op.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraLayer

from .errors import UserError
from .grouped_lora import Plan, add_grouped_, make_plan, plain_weights
from .models import BaseModel, Registry, TrainingModel
from .rollback import check_grad_max_abs, check_losses
from .tensors import wire
from .chunked_logprobs import token_offset
from .packing import LAYOUTS, Layout, Staged, isolates_datums
from .train import Datum, ForwardBackwardRequest, batch_logprobs, layout, parse_forward_backward, stage

#: The most members one group takes (the agent groups fewer: TB_COBATCH_MAX).
MAX_MEMBERS = 64

#: Whether a layer's members run as one grouped LoRA product (grouped_lora.py) where it applies;
#: False runs each adapter over its run of tokens. Benchmarks set it to measure the two in one process.
GROUPED = True


@dataclass
class _Member:
    slot: int
    model: TrainingModel
    req: ForwardBackwardRequest
    saved: torch.Tensor | None
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    total: float = 0.0
    error: str | None = None

    @property
    def trains(self) -> bool:
        return not self.req.forward_only


def forward_backward_group(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    raw = args.get("members")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_MEMBERS:
        raise UserError(f"members must be a list of 1 to {MAX_MEMBERS} forward_backward requests")
    results: list[dict[str, Any] | None] = [None] * len(raw)
    members: list[_Member] = []
    seen: set[str] = set()
    for slot, m in enumerate(raw):
        try:
            if not isinstance(m, dict):
                raise UserError("a member must be a forward_backward request object")
            model = registry.model(str(m.get("model_id")))
            if model.model_id in seen:
                raise UserError(f"model {model.model_id} appears twice in one group")
            seen.add(model.model_id)
            if members and model.base is not members[0].model.base:
                raise UserError("every member of a group must be of one base model")
            req = parse_forward_backward(m, model.base)
        except UserError as e:
            results[slot] = {"error": {"category": "user", "message": str(e)}}
            continue
        saved = None if req.forward_only else model.flat.grads_saved()
        members.append(_Member(slot, model, req, saved))
    if members:
        _run(members[0].model.base, members)
    for m in members:
        if m.error is not None:
            results[m.slot] = {"error": {"category": "user", "message": m.error}}
            continue
        if m.trains:
            m.model.flat.pending = True
        outputs = [m.outputs[d.index] for d in m.req.datums]
        results[m.slot] = {"loss_fn_outputs": [{"logprobs": wire(lp)} for lp in outputs], "metrics": {"loss:sum": m.total}}
    return {"results": results}


def _run(base: BaseModel, members: list[_Member]) -> None:
    owner: dict[int, _Member] = {}
    datums: list[Datum] = []
    for m in members:
        for d in m.req.datums:
            owner[id(d)] = m
            datums.append(d)
    trainers = [m for m in members if m.trains]
    # Every member's adapter layers on; each trainable member's parameters require grad. `activate`
    # records its adapter as the one trainable; the others are set back below.
    lead = trainers[0] if trainers else members[0]
    base.activate(lead.model.adapter, trainable=bool(trainers))
    others = [m for m in trainers if m is not lead]
    for m in others:
        for p in m.model.parameters():
            p.requires_grad_(True)
    try:
        for staged in stage(datums, base, group_layout(base, datums)):
            _run_batch(base, staged, [owner[id(d)] for d in staged.batch])
    except BaseException:
        for m in trainers:
            m.model.flat.restore_grads(m.saved)
        raise
    finally:
        for m in others:
            for p in m.model.parameters():
                p.requires_grad_(False)
    for m in trainers:
        if m.error is not None:
            m.model.flat.restore_grads(m.saved)


def group_layout(base: BaseModel, datums: list[Datum] | None = None) -> Layout:
    """The engine's layout, except that members' datums share a packed row only where its attention
    computes nothing across datums (packing.isolates_datums: flash-attn's variable-length kernel);
    elsewhere (SDPA's block-diagonal mask) a member's non-finite loss would reach its neighbours'
    gradients through the masked scores, so the group is padded, one datum per row."""
    engine_layout = layout(base, datums)
    if engine_layout.name == "packed" and not isolates_datums(base):
        return LAYOUTS["padded"]
    return engine_layout


def _run_batch(base: BaseModel, staged: Staged, rows: list[_Member]) -> None:
    """Forward (and backward of the trainable members' losses) of one micro-batch; each datum's
    tokens (its slot) through its owner's adapter. One device -> host copy at the end, as forward_backward's."""
    batch: list[Datum] = staged.batch
    names = [m.model.adapter for m in rows]
    here = list({id(m): m for m in rows}.values())
    live = [m for m in here if m.trains and m.error is None]
    # The token segments stay in force through the backward: the output layer's chunks are recomputed
    # there (chunked_logprobs.py) and must run each adapter over the same tokens as in the forward.
    segments = nullcontext() if len(set(names)) == 1 else _token_segments(base, _segments(names, staged.slots))
    with torch.set_grad_enabled(bool(live)), segments:
        lps = batch_logprobs(base, staged)
        losses = torch.stack([m.req.loss.fn(lp, inputs, m.req.config) for m, lp, inputs in zip(rows, lps, staged.inputs)])
        # Each member's summed loss over its rows here (float32 on the device, as forward_backward sums a micro-batch).
        sums = torch.stack([losses[_rows_of(m, rows)].sum() for m in here])
        checks = [losses.detach().float(), sums.detach().float()]
        if live:
            torch.stack([sums[here.index(m)] for m in live]).sum().backward()
            # Each live member's gradient max-abs (rollback.grad_max_abs of its flat gradient), one
            # multi-tensor kernel for all of them.
            checks.append(torch.stack(torch._foreach_norm([m.model.flat.grad for m in live], float("inf"))).float())
        host = torch.cat([*checks, *(lp.detach().reshape(-1) for lp in lps)]).cpu()
    at = len(batch) + len(here) + (len(live) if live else 0)
    for m, d in zip(rows, batch):
        n = d.targets.numel()
        m.outputs[d.index] = host[at : at + n].reshape(d.targets.shape)
        at += n
    for k, m in enumerate(here):
        if m.error is not None:
            continue
        mine = [r for r, o in enumerate(rows) if o is m]
        try:
            check_losses([batch[r].index for r in mine], [host[r] for r in mine], [m.outputs[batch[r].index] for r in mine])
            if m in live:
                check_grad_max_abs([batch[r].index for r in mine], float(host[len(batch) + len(here) + live.index(m)]))
        except UserError as e:
            m.error = str(e)
            continue
        m.total += float(host[len(batch) + k])


def _rows_of(m: _Member, rows: list[_Member]) -> slice | list[int]:
    """The micro-batch rows of ``m``'s datums: a slice where they are consecutive (as staged, see
    ``_segments``: no index list to copy to the device), else their list."""
    mine = [r for r, o in enumerate(rows) if o is m]
    return slice(mine[0], mine[-1] + 1) if mine[-1] - mine[0] + 1 == len(mine) else mine


def _segments(names: list[str], slots: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """The micro-batch's token axis (flattened B x L) as runs of one adapter: (adapter, first token,
    token after the last). A member's datums are consecutive in a micro-batch (its datums are staged
    in order, one member after another), so its slots are one run."""
    out: list[tuple[str, int, int]] = []
    for name, (first, end) in zip(names, slots):
        if out and out[-1][0] == name and out[-1][2] == first:
            out[-1] = (name, out[-1][1], end)
        else:
            out.append((name, first, end))
    return out


@contextmanager
def _token_segments(base: BaseModel, segments: list[tuple[str, int, int]]) -> Iterator[None]:
    """Every LoRA linear layer of the base runs, for this pass, its base layer over all tokens and each
    adapter over its run of tokens: the members present in a layer as one grouped product
    (grouped_lora.py: a fixed number of kernels per layer, whatever the number of members), or, where
    one member is present or the grouped form does not apply (dropout, a PEFT variant), each adapter
    over its run, a slice (``_one_by_one``). The same sums as PEFT's LoRA forward:
    base(x) + lora_B(lora_A(dropout(x))) * scaling, per token.

    A layer's input is the micro-batch's tokens flattened (B x L or a packed row's T), or, for the
    output layer, a chunk of them starting at ``token_offset()`` (chunked_logprobs.py): each segment
    is cut to the tokens the layer is given. The grouped product's index tensors are made once per
    such cut and set of members (``plans``), not per layer: no host-to-device copy per layer (PEFT's
    per-row ``adapter_names`` path makes one per layer and adapter, which costs more on a GPU than
    separate passes, docs/benchmarks.md)."""
    assert base.peft is not None
    found = _lora_layers(base.peft)
    layers = [m for m in found if isinstance(m, LoraLinear)]
    others = [type(m).__name__ for m in found if not isinstance(m, LoraLinear)]
    if others:  # the engine's adapters are on linear layers only (models.py LoraSpec)
        raise RuntimeError(f"co-batching runs LoRA on linear layers only, not on {sorted(set(others))}")
    plans: dict[tuple[Any, ...], Plan] = {}

    def forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        tokens = x.reshape(-1, x.shape[-1])
        out_tokens = result.view(-1, result.shape[-1])
        offset = token_offset()
        n = tokens.shape[0]
        runs: list[tuple[str, int, int]] = []  # the segments on this layer, cut to its tokens
        for adapter, first, end in segments:
            lo, hi = max(first, offset) - offset, min(end, offset + n) - offset
            if adapter in self.lora_A and lo < hi:
                runs.append((adapter, lo, hi))
        weights = plain_weights(self, [adapter for adapter, _, _ in runs]) if GROUPED and len(runs) > 1 else None
        if weights is not None:
            scaling = self.scaling
            scalings = tuple(float(scaling[adapter]) for adapter, _, _ in runs)
            key = (tuple(runs), scalings)
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = make_plan(runs, list(scalings), tokens.device, weights[0][0].dtype)
            add_grouped_(weights, tokens, out_tokens, plan)
        else:
            _one_by_one(self, tokens, out_tokens, runs)
        return result

    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _lora_layers(module: torch.nn.Module) -> list[LoraLayer]:
    """The LoRA layers under ``module``, not looking inside them: each holds a module per adapter, so
    the whole tree, walked per micro-batch, grows with the adapters loaded (thousands of modules)."""
    if isinstance(module, LoraLayer):
        return [module]
    return [layer for child in module.children() for layer in _lora_layers(child)]


def _one_by_one(layer: LoraLinear, tokens: torch.Tensor, out: torch.Tensor, runs: list[tuple[str, int, int]]) -> None:
    """``out[lo:hi] += lora_B(lora_A(dropout(tokens[lo:hi]))) * scaling``, one adapter's run at a time."""
    for adapter, lo, hi in runs:
        lora_a = layer.lora_A[adapter]
        part = tokens[lo:hi].to(lora_a.weight.dtype)
        delta = layer.lora_B[adapter](lora_a(layer.lora_dropout[adapter](part))) * layer.scaling[adapter]
        out[lo:hi] += delta.to(out.dtype)
