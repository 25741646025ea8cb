"""PyTorch's own variable-length attention kernel as a transformers attention implementation.

``torch.nn.attention.varlen.varlen_attn`` (PyTorch's CUDA build carries FlashAttention-2) takes the
tokens of several sequences concatenated, (T, H, D), with their cumulative lengths, and attends only
within each sequence: what a packed row needs (packing.py), in O(T) memory, with nothing installed
beyond torch. The flash-attn package gives the same through transformers' ``flash_attention_2``; this
is the way where it is not installed (building it needs the CUDA toolkit and hours; its wheels are not
on the package index for every torch).

``NAME`` is registered with transformers' ``AttentionInterface`` (the attention function below) and
``AttentionMaskInterface`` (flash attention's mask function: no dense mask is built, the kernel gets the
cumulative lengths that packing.stage_packed staged, as for flash-attn). ``packing.attention_for``
switches a base model to it for a packed forward and back afterwards.

Two signatures of ``varlen_attn`` exist: the first (``is_causal``, key and value with as many heads as
the query) and the later one (``window_size``, ``enable_gqa``, ``scale``). ``call`` speaks both: on the
first it repeats the key and value heads for grouped-query attention, as the model's eager attention
does.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

NAME = "tb_varlen"

Kernel = Callable[..., Any]


@functools.cache
def kernel() -> Kernel | None:
    """torch's varlen_attn, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def available(device: torch.device) -> bool:
    return device.type == "cuda" and kernel() is not None


def call(fn: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
         scale: float | None) -> torch.Tensor:
    """Causal attention within each sequence of the packed ``q``/``k``/``v`` (T, heads, head_dim),
    sequence i being tokens ``cu[i]:cu[i+1]``; returns (T, query heads, head_dim)."""
    params = inspect.signature(fn).parameters
    kw: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # as the model's eager attention does
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        raise ValueError(f"this torch's varlen_attn has no scale argument and the model's scale {scale} is not "
                         f"1/sqrt(head_dim) = {q.shape[-1] ** -0.5}")
    out = fn(q, k, v, cu, cu, max_len, max_len, **kw)
    return out[0] if isinstance(out, tuple) else out


_bounds: list[Any] = [None, None]  # the last position ids seen and their bounds (every layer of a forward reads them)


def bounds_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A packed row's cumulative lengths and longest sequence from its (1, T) position ids, a sequence
    starting wherever a position is not its predecessor's plus one (as transformers reads packed rows):
    how a caller that stages no ``cu_seq_lens`` (verl's padding-free forward) reaches this kernel. The
    last row's bounds are kept (one host read per forward, not per layer)."""
    if _bounds[0] is position_ids:
        return _bounds[1]
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    edges = torch.cat([starts.nonzero().reshape(-1), pos.new_tensor([pos.numel()])]).to(torch.int32)
    found = (edges, int(edges.diff().max()))
    _bounds[0], _bounds[1] = position_ids, found
    return found


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (1, heads, T, head_dim) of one packed row, key
    and value (1, kv heads, T, head_dim); the row's cumulative lengths in ``cu_seq_lens_q`` and the
    longest in ``max_length_q`` (packing stages both), else read from ``position_ids``
    (``bounds_from_positions``); returns (1, T, heads, head_dim) and no weights."""
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None and kwargs.get("position_ids") is not None and query.shape[0] == 1:
        cu, max_len = bounds_from_positions(kwargs["position_ids"])
    if cu is None or max_len is None or query.shape[0] != 1:
        raise ValueError(f"attention '{NAME}' runs packed rows only (one row, with cu_seq_lens_q and max_length_q "
                         f"or position ids); got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention '{NAME}' has no dropout (the model asked for {dropout})")
    fn = kernel()
    if fn is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    out = call(fn, q, k, v, cu.to(device=q.device, dtype=torch.int32), int(max_len), scaling)
    return out.unsqueeze(0), None


@functools.cache
def register() -> str:
    """Registers ``NAME`` with transformers (once) and returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME
