"""How a forward_backward's datums become micro-batches on the device: packed or padded.

- ``packed``: consecutive datums whose tokens together stay within the micro-batch budget
  (``TB_ENGINE_MAX_BATCH_TOKENS``, real tokens) are concatenated into one row of shape (1, T).
  Position ids restart at 0 at each datum, and nothing else marks the datums: the model's own
  packed-sequence support (transformers' masking_utils, ``find_packed_sequence_indices``) reads the
  restarts and keeps attention within each datum: a block-diagonal causal mask for SDPA or eager
  attention, a document mask for flex attention, and for flash attention the variable-length kernel,
  given the cumulative lengths (``cu_seq_lens_*``) staged here, so that it need not derive them from
  the position ids on the device. No padding token is computed.
- ``padded``: datums right-padded to the longest of the micro-batch, (B, L), at most the budget in
  padded tokens. Attention is causal and mask-free (no real token can see a pad).

Either way a staged micro-batch says, for every datum, its slot: the range of the flattened (B x L)
token axis it owns (its tokens, then its padding if any); train.py reads hidden states and targets by
slot, cobatch.py runs each adapter over its members' slots.

The attention kernel: with ``packed`` on a CUDA device with 16-bit weights, the forward runs on a
variable-length kernel (O(T) memory, nothing computed across datums): transformers'
``flash_attention_2`` where flash-attn is installed, else torch's own ``varlen_attn`` (varlen.py,
registered with transformers as ``tb_varlen``). Elsewhere it runs on the model's own implementation
(SDPA with the block-diagonal mask: exact, but its mask and scores grow with T^2, which
TB_ENGINE_MAX_BATCH_TOKENS bounds). ``TB_ENGINE_LAYOUT`` ``auto`` (the default, ``resolve``) packs only
in the first case, and only an op whose padding would add at least ``AUTO_PACK_PADDING`` of its real
tokens: where there is little padding to save, the padded batch's causal SDPA runs faster than the
variable-length kernel (on an H100 at the 1.7B shape, an op of 2 x 256 tokens took 170 ms packed
against 142 ms padded).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import varlen as torch_varlen

if TYPE_CHECKING:
    from .models import BaseModel
    from .train import Datum

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", torch_varlen.NAME)


@dataclass
class Staged:
    """One micro-batch's inputs on the device.

    ``ids`` (B, L); ``position_ids`` (1, T) when packed (None: 0..L-1 in every row); ``slots`` each
    datum's (first, end) in the flattened B x L token axis; ``targets`` flattened to (B x L, *tail)
    when every datum's targets share a trailing shape (padding targets 0: their logprobs are unused,
    so their gradient is 0), else one tensor per datum; ``inputs`` each datum's float loss inputs;
    ``varlen`` the variable-length attention arguments of a packed row (cumulative lengths on the
    device, longest datum), used only by a flash kernel.
    """

    batch: list[Datum]
    ids: torch.Tensor
    position_ids: torch.Tensor | None
    slots: list[tuple[int, int]]
    targets: torch.Tensor | list[torch.Tensor]
    inputs: list[dict[str, torch.Tensor]]
    varlen: dict[str, Any] = field(default_factory=dict)

    @property
    def packed(self) -> bool:
        return self.position_ids is not None


def _length(d: Datum) -> int:
    return int(d.tokens.shape[0])


def padded_groups(datums: list[Datum], budget: int) -> Iterator[list[Datum]]:
    """Consecutive groups whose padded size (count x longest) stays within ``budget`` tokens."""
    batch: list[Datum] = []
    longest = 0
    for d in datums:
        n = _length(d)
        if batch and max(longest, n) * (len(batch) + 1) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(d)
        longest = max(longest, n)
    if batch:
        yield batch


def packed_groups(datums: list[Datum], budget: int) -> Iterator[list[Datum]]:
    """Consecutive groups whose tokens together stay within ``budget`` (a longer datum: alone)."""
    batch: list[Datum] = []
    total = 0
    for d in datums:
        n = _length(d)
        if batch and total + n > budget:
            yield batch
            batch, total = [], 0
        batch.append(d)
        total += n
    if batch:
        yield batch


def _flat_targets(batch: list[Datum], slots: list[tuple[int, int]], size: int) -> torch.Tensor | None:
    """Every datum's targets in one (size, *tail) tensor at its slot, or None when the tails differ."""
    tails = {tuple(d.targets.shape[1:]) for d in batch}
    if len(tails) != 1:
        return None
    (tail,) = tails
    flat = torch.zeros((size, *tail), dtype=torch.int64)
    for (first, _), d in zip(slots, batch):
        flat[first : first + _length(d)] = d.targets
    return flat


def _finish(batch: list[Datum], ids: torch.Tensor, position_ids: torch.Tensor | None, slots: list[tuple[int, int]],
            device: torch.device, varlen: dict[str, Any] | None = None) -> Staged:
    flat = _flat_targets(batch, slots, ids.numel())
    targets: torch.Tensor | list[torch.Tensor] = flat.to(device) if flat is not None else [d.targets.to(device) for d in batch]
    inputs = [{k: v.to(device) for k, v in d.inputs.items()} for d in batch]
    pos = position_ids.to(device) if position_ids is not None else None
    return Staged(batch, ids.to(device), pos, slots, targets, inputs, varlen or {})


def stage_padded(batch: list[Datum], device: torch.device) -> Staged:
    longest = max(_length(d) for d in batch)
    ids = torch.zeros((len(batch), longest), dtype=torch.int64)
    for row, d in enumerate(batch):
        ids[row, : _length(d)] = d.tokens
    slots = [(row * longest, (row + 1) * longest) for row in range(len(batch))]
    return _finish(batch, ids, None, slots, device)


def stage_packed(batch: list[Datum], device: torch.device) -> Staged:
    lengths = [_length(d) for d in batch]
    ids = torch.cat([d.tokens for d in batch]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]).unsqueeze(0)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    slots = list(zip(bounds[:-1], bounds[1:]))
    cu = torch.tensor(bounds, dtype=torch.int32).to(device)
    longest = max(lengths)
    varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return _finish(batch, ids, position_ids, slots, device, varlen)


@dataclass(frozen=True)
class Layout:
    """A way to form and stage micro-batches: its grouping under the token budget and its staging."""

    name: str
    groups: Callable[[list[Datum], int], Iterator[list[Datum]]]
    stage: Callable[[list[Datum], torch.device], Staged]


LAYOUTS: dict[str, Layout] = {
    "packed": Layout("packed", packed_groups, stage_packed),
    "padded": Layout("padded", padded_groups, stage_padded),
}


def stage_all(datums: list[Datum], layout: Layout, budget: int, device: torch.device) -> list[Staged]:
    """Every micro-batch's host -> device copies, made before the op's first kernel.

    A copy from pageable host memory waits for the device's stream to drain; made between the
    forward and the loss (as the inputs are needed) it would stall the GPU mid-step, made here the
    stream is idle anyway (the previous op ended with its host copy).
    """
    return [layout.stage(batch, device) for batch in layout.groups(datums, budget)]


@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_available(base: BaseModel) -> bool:
    """Whether the packed row can run on a variable-length kernel here (flash-attn's or torch's)."""
    return (base.device.type == "cuda" and base.placement.dtype in (torch.bfloat16, torch.float16)
            and (_flash_attn_installed() or torch_varlen.available(base.device)))


def varlen_implementation() -> str:
    """The transformers attention implementation a packed row runs on where ``flash_available``:
    flash-attn's when it is installed, else torch's varlen_attn (registered on first use)."""
    return "flash_attention_2" if _flash_attn_installed() else torch_varlen.register()


def isolates_datums(base: BaseModel) -> bool:
    """Whether a packed row's attention computes nothing across its datums: a variable-length kernel
    (flash-attn's, torch's) does not; a masked dense kernel (SDPA, eager) computes every pair and
    multiplies the masked ones by 0, so a datum whose values are not finite makes its neighbours'
    gradients NaN (0 x inf). Co-batching packs only where datums are isolated, so that one member's
    non-finite loss fails that member alone (cobatch.py)."""
    return base.hf.config._attn_implementation in FLASH_IMPLEMENTATIONS or flash_available(base)


#: ``auto`` packs an op whose padded micro-batches would hold at least this share more tokens than
#: its datums (padding / real tokens). Below it the padding saved is worth less than the packed
#: row's cost: at no padding the variable-length kernel ran 1.2x slower than the padded batch's
#: causal SDPA (docs/benchmarks.md, "Co-batching", H100, 2 x 256 tokens); 16 datums of 64-2048
#: tokens (about 1x padding) ran 1.58x faster packed.
AUTO_PACK_PADDING = 0.25


def padding_share(datums: list[Datum], budget: int) -> float:
    """The padding the padded layout would compute for ``datums``, as a share of their real tokens."""
    real = sum(_length(d) for d in datums)
    padded = sum(len(g) * max(_length(d) for d in g) for g in padded_groups(datums, budget))
    return (padded - real) / real if real else 0.0


def resolve(name: str, base: BaseModel, datums: list[Datum] | None = None, budget: int = 0) -> Layout:
    """The layout of setting ``name`` (``TB_ENGINE_LAYOUT``) on ``base``: ``auto`` is packed where the
    attention kernel is variable-length (``isolates_datums``) and, given the op's ``datums`` (and the
    micro-batch ``budget``), where padding them would add at least ``AUTO_PACK_PADDING`` of their
    tokens; else padded. With a masked dense kernel a packed row computes every pair of its T tokens
    (T^2 scores for the sum of its datums' n^2): on the CPU bench (bench/packing.py) 0.62x the padded
    tokens/s at 2.4x the memory."""
    if name == "auto":
        if not isolates_datums(base):
            return LAYOUTS["padded"]
        if datums and padding_share(datums, budget) < AUTO_PACK_PADDING:
            return LAYOUTS["padded"]
        return LAYOUTS["packed"]
    return LAYOUTS[name]


@contextmanager
def attention_for(base: BaseModel, staged: Staged) -> Iterator[dict[str, Any]]:
    """The decoder's extra forward arguments for ``staged``, with the attention implementation its
    layout runs on set for the block (and the model's own restored after it: sampling keeps it)."""
    if not staged.packed:
        yield {}
        return
    own = base.hf.config._attn_implementation
    if own in FLASH_IMPLEMENTATIONS:
        yield staged.varlen
        return
    if not flash_available(base):
        yield {}  # the model's packed-sequence mask from the position ids
        return
    base.hf.set_attn_implementation(varlen_implementation())
    try:
        yield staged.varlen
    finally:
        base.hf.set_attn_implementation(own)
