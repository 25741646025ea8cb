"""Tinker datums <-> verl batches, and the loss verl calls: pure torch, no verl or tensordict import.

verl's FSDP engine (0.9, ``pad_mode`` NO_PADDING) takes jagged nested tensors with one row per
sequence and returns ``log_probs`` jagged the same way, where position ``t`` of a row is
``log p(input_ids[t+1] | input_ids[:t+1])`` (it rolls the packed ids by -1; the last position of a
row scores the next row's first token and is meaningless). A Tinker datum has ``tokens`` (N) and
``target_tokens`` (N) with ``lp[i] = log p(target[i] | tokens[:i+1])``. When the targets are the
next tokens (``target[i] == tokens[i+1]`` for ``i < N-1``, the only shape verl can score) the row
``input_ids = tokens + [target[N-1]]`` (N+1 ids) makes verl's positions ``0..N-1`` exactly ``lp``.

Per-token loss inputs travel as jagged float rows of the same N+1 length (0 at the extra position)
under ``tb_``-prefixed keys, plus a per-row ``tb_scale`` (1 for a datum, 0 for the padding rows that
give every data-parallel rank at least one row). The loss is ours (``tinker_engine.losses``): for
every row, ``scale * spec.fn(lp[:N], inputs[:N], config)``, summed. verl's FSDP averages gradients
over the data-parallel ranks, so each rank returns its local sum times ``dp_size``; the gradient is
then that of the sum over all datums, as in the torch engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tinker_engine.errors import UserError
from tinker_engine.losses import LossSpec

# Float loss inputs a loss can take, as the torch engine names them (``LossSpec`` inputs).
FLOAT_INPUTS = ("weights", "advantages", "logprobs")
PREFIX = "tb_"
SCALE_KEY = "tb_scale"
INDEX_KEY = "tb_datum"


@dataclass(frozen=True)
class Datum:
    """What the translation needs of one validated datum (``tinker_engine.train.Datum`` fits)."""

    index: int
    tokens: torch.Tensor  # (N,) int64
    targets: torch.Tensor  # (N,) int64
    inputs: Mapping[str, torch.Tensor]  # float32, each (N,)


def check_next_token_targets(datum: Any) -> None:
    """A UserError unless ``datum``'s targets are its next tokens (what verl's rolled logprobs score)."""
    where = f"datum {datum.index}"
    if datum.targets.dim() != 1:
        raise UserError(f"{where}: the verl engine scores one target per position; target_tokens of shape "
                        f"{list(datum.targets.shape)} (top-K) need the torch engine")
    n = datum.tokens.shape[0]
    if n > 1 and not torch.equal(datum.targets[:-1], datum.tokens[1:]):
        pos = int((datum.targets[:-1] != datum.tokens[1:]).nonzero()[0, 0])
        raise UserError(f"{where}: the verl engine needs target_tokens[i] == tokens[i+1] (next-token targets); "
                        f"position {pos} has target {int(datum.targets[pos])} but the next token is "
                        f"{int(datum.tokens[pos + 1])}")


def shard_rows(n_datums: int, world_size: int, rank: int) -> list[int | None]:
    """The datum index of each row this rank computes; ``None`` is a padding row (scale 0).

    Datum ``i`` goes to rank ``i % world_size``; every rank gets ``max(1, ceil(n / world_size))``
    rows, so none is empty (verl cannot run an empty batch) and all run the same number of rows.
    """
    if n_datums <= 0:
        raise UserError("data must hold at least one datum")
    per_rank = max(1, math.ceil(n_datums / world_size))
    rows: list[int | None] = list(range(rank, n_datums, world_size))
    return rows + [None] * (per_rank - len(rows))


def _jagged(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def build_fields(datums: Sequence[Any], rows: Sequence[int | None],
                 input_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensor fields of the verl batch for ``rows`` (indices into ``datums``; None = padding).

    ``input_names``: the float loss inputs to carry. A datum lacking one of them gets ones for
    ``weights`` (the loss's own default) and is otherwise refused by validation before this.
    Padding rows repeat datum 0's tokens with scale 0.
    """
    ids, pos, mask, scale, index = [], [], [], [], []
    floats: dict[str, list[torch.Tensor]] = {name: [] for name in input_names}
    for row in rows:
        d = datums[0 if row is None else row]
        n = int(d.tokens.shape[0])
        ids.append(torch.cat([d.tokens.to(torch.int64), d.targets[-1:].to(torch.int64)]))
        pos.append(torch.arange(n + 1, dtype=torch.int64))
        mask.append(torch.cat([torch.ones(n, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]))
        scale.append(0.0 if row is None else 1.0)
        index.append(-1 if row is None else int(row))
        for name in input_names:
            value = d.inputs.get(name)
            if value is None:
                if name != "weights":
                    raise UserError(f"datum {d.index}: loss input '{name}' is missing")
                value = torch.ones(n, dtype=torch.float32)
            floats[name].append(torch.cat([value.to(torch.float32).reshape(n), torch.zeros(1)]))
    fields = {
        "input_ids": _jagged(ids),
        "position_ids": _jagged(pos),
        "loss_mask": _jagged(mask),
        SCALE_KEY: torch.tensor(scale, dtype=torch.float32),
        INDEX_KEY: torch.tensor(index, dtype=torch.int64),
    }
    for name, values in floats.items():
        fields[PREFIX + name] = _jagged(values)
    return fields


def input_names_for(spec: LossSpec, datums: Sequence[Any]) -> list[str]:
    """The float inputs the batch carries for ``spec``: required ones, optional ones any datum has."""
    names = list(spec.required_inputs)
    names += [n for n in spec.optional_inputs if any(n in d.inputs for d in datums)]
    return names


def non_tensor_fields(fields: Mapping[str, torch.Tensor], max_token_len: int, remove_padding: bool = False) -> dict[str, Any]:
    """The batch's metadata for verl's FSDP engine (``tu.assign_non_tensor`` values); ``remove_padding``:
    the rows of a micro-batch packed into one (levers.py)."""
    lengths = fields["input_ids"].offsets().diff().tolist()
    return {
        "temperature": 1.0,
        "use_remove_padding": bool(remove_padding),
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": int(max(max_token_len, max(lengths))),
        "global_token_num": [int(x) for x in lengths],
        "calculate_entropy": False,
    }


def _rows_of(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """A jagged tensor's packed values and its row offsets."""
    return t.values(), [int(x) for x in t.offsets().tolist()]


def _get(data: Any, key: str, default: Any = None) -> Any:
    """``data[key]`` for a TensorDict (NonTensorData unwrapped) or a plain mapping."""
    try:
        value = data[key]
    except KeyError:
        return default
    kind = type(value).__name__
    if kind == "NonTensorData":
        return value.data
    if kind == "NonTensorStack":  # a per-row copy of one value
        values = value.tolist()
        return values[0] if values else default
    return value


def row_losses(spec: LossSpec, config: Mapping[str, float], log_probs: torch.Tensor,
               data: Any, input_names: Sequence[str]) -> torch.Tensor:
    """Each row's ``scale * loss`` (a (B,) tensor) from verl's jagged ``log_probs``."""
    lp_values, lp_off = _rows_of(log_probs)
    ids_off = _rows_of(data["input_ids"])[1]
    scale = data[SCALE_KEY]
    packed = {name: _rows_of(data[PREFIX + name]) for name in input_names}
    losses = []
    for b in range(len(lp_off) - 1):
        n = ids_off[b + 1] - ids_off[b] - 1
        if lp_off[b + 1] - lp_off[b] != n + 1:
            raise RuntimeError(f"verl returned {lp_off[b + 1] - lp_off[b]} logprobs for a row of {n + 1} ids")
        lp = lp_values[lp_off[b]: lp_off[b] + n].float()
        inputs = {}
        for name, (values, off) in packed.items():
            inputs[name] = values[off[b]: off[b] + n].to(device=lp.device, dtype=torch.float32)
        losses.append(spec.fn(lp, inputs, config) * scale[b].to(device=lp.device, dtype=torch.float32))
    return torch.stack(losses)


def make_loss_fn(spec: LossSpec, config: Mapping[str, float],
                 input_names: Sequence[str]) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """The ``loss_fn(model_output, data, dp_group=None) -> (loss, metrics)`` verl's engine calls per micro-batch."""

    def loss_fn(model_output: Mapping[str, Any], data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        if "student_logits" in model_output:  # verl's top-K distillation hook; never enabled here
            raise RuntimeError("the verl engine's loss does not process logits")
        total = row_losses(spec, config, model_output["log_probs"], data, input_names).sum()
        dp_size = int(_get(data, "dp_size", 1) or 1)
        return total * dp_size, {}

    return loss_fn


def row_logprobs(log_probs: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per row, the first N logprobs (the datum's ``lp``) as float32 CPU tensors."""
    lp_values, lp_off = _rows_of(log_probs)
    ids_off = _rows_of(fields["input_ids"])[1]
    if len(lp_off) != len(ids_off):
        raise RuntimeError(f"verl returned {len(lp_off) - 1} rows of logprobs for {len(ids_off) - 1} rows")
    out = []
    for b in range(len(ids_off) - 1):
        n = ids_off[b + 1] - ids_off[b] - 1
        out.append(lp_values[lp_off[b]: lp_off[b] + n].detach().to("cpu", torch.float32))
    return out


def describe_fields(fields: Mapping[str, Any], max_values: int | None = None) -> dict[str, Any]:
    """A JSON description of a batch (for fixtures): per key its dtype, layout, shape or row lengths, values."""
    out: dict[str, Any] = {}
    for key, value in sorted(fields.items()):
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                values, offsets = _rows_of(value)
                flat = values.detach().cpu().reshape(-1)
                out[key] = {"layout": "jagged", "dtype": str(values.dtype).replace("torch.", ""),
                            "offsets": offsets, "values": flat[:max_values].tolist()}
            else:
                flat = value.detach().cpu().reshape(-1)
                out[key] = {"layout": "strided", "dtype": str(value.dtype).replace("torch.", ""),
                            "shape": list(value.shape), "values": flat[:max_values].tolist()}
        else:
            out[key] = {"layout": "non_tensor", "value": value if isinstance(value, (int, float, str, bool, list))
                        or value is None else repr(value)}
    return out


def jagged_from_description(desc: Mapping[str, Any]) -> torch.Tensor:
    """The jagged tensor ``describe_fields`` described (all its values must have been kept)."""
    dtype = getattr(torch, desc["dtype"])
    values = torch.tensor(desc["values"], dtype=dtype)
    offsets = desc["offsets"]
    if len(values) != offsets[-1]:
        raise ValueError("the description kept only part of the values")
    return _jagged([values[offsets[i]: offsets[i + 1]] for i in range(len(offsets) - 1)])
