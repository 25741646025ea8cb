"""Request tensors to torch: binary ones arrive decoded (channel.py); inline JSON tensors
``{"dtype", "shape", "data"}`` (row-major) are still accepted. Replies carry ``torch.Tensor`` values,
which the channel sends as binary."""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import UserError
from .params import is_int

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "int64": torch.int64}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Inline tensors may use the wire's int32 for ids, as binary ones do; both arrive widened to int64.
_INLINE: dict[str, torch.dtype] = {**DTYPES, "int32": torch.int64}


def tensor_from_json(obj: Any, what: str) -> torch.Tensor:
    """A request tensor (on CPU): decoded from the frame's binary part already, or an inline JSON one.
    ``what`` names it in error messages."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in _NAMES:
            raise UserError(f"{what}: dtype must be one of {sorted(DTYPES)}, got {obj.dtype}")
        return obj
    if not isinstance(obj, dict):
        raise UserError(f"{what}: a tensor must be an object with dtype, shape and data")
    dtype_name = obj.get("dtype")
    if dtype_name not in _INLINE:
        raise UserError(f"{what}: dtype must be one of {sorted(_INLINE)}, got {dtype_name!r}")
    shape = obj.get("shape")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise UserError(f"{what}: shape must be a list of non-negative integers, got {shape!r}")
    data = obj.get("data")
    if not isinstance(data, list):
        raise UserError(f"{what}: data must be a list of numbers")
    expected = math.prod(shape)
    if len(data) != expected:
        raise UserError(f"{what}: shape {shape} needs {expected} values, data has {len(data)}")
    dtype = _INLINE[dtype_name]
    if dtype == torch.int64:
        if not all(is_int(v) for v in data):
            raise UserError(f"{what}: int64 data must be integers")
    elif not all(is_int(v) or isinstance(v, float) for v in data):
        raise UserError(f"{what}: float32 data must be numbers")
    return torch.tensor(data, dtype=dtype).reshape(shape)


def wire(t: torch.Tensor) -> torch.Tensor:
    """A result tensor as it travels: float32 or int64, on the CPU (the channel sends its bytes)."""
    t = t.detach()
    return t.to(device="cpu", dtype=torch.float32 if t.is_floating_point() else torch.int64)


def tensor_to_json(t: torch.Tensor) -> dict[str, Any]:
    """An inline JSON tensor (for hand-written requests and tests); float32 values widen to double exactly."""
    t = t.detach()
    if t.is_floating_point():
        t = t.to(torch.float32)
    elif t.dtype != torch.int64:
        t = t.to(torch.int64)
    return {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data": t.cpu().reshape(-1).tolist()}
