"""Typed access to the JSON ``args`` of a request; every mistake becomes a ``UserError``.

Each function names the offending field (``where`` is a dotted path such as ``lora``)
so the message that reaches the client says exactly what was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import UserError

_MISSING = object()


def _field(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _get(obj: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise UserError(f"missing required field '{_field(where, key)}'")
        return default
    return value


def get_obj(obj: Mapping[str, Any], key: str, where: str = "", default: Any = _MISSING) -> dict[str, Any]:
    value = _get(obj, key, where, default)
    if not isinstance(value, dict):
        raise UserError(f"'{_field(where, key)}' must be an object, got {type(value).__name__}")
    return value


def get_str(obj: Mapping[str, Any], key: str, where: str = "", default: Any = _MISSING) -> str:
    value = _get(obj, key, where, default)
    if not isinstance(value, str) or not value:
        raise UserError(f"'{_field(where, key)}' must be a non-empty string")
    return value


def get_opt_str(obj: Mapping[str, Any], key: str, where: str = "") -> str | None:
    if obj.get(key) is None:
        return None
    return get_str(obj, key, where)


def get_bool(obj: Mapping[str, Any], key: str, where: str = "", default: Any = _MISSING) -> bool:
    value = _get(obj, key, where, default)
    if not isinstance(value, bool):
        raise UserError(f"'{_field(where, key)}' must be a boolean")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_int(obj: Mapping[str, Any], key: str, where: str = "", default: Any = _MISSING,
            minimum: int | None = None) -> int:
    value = _get(obj, key, where, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise UserError(f"'{_field(where, key)}' must be an integer")
    if minimum is not None and value < minimum:
        raise UserError(f"'{_field(where, key)}' must be >= {minimum}, got {value}")
    return value


def get_opt_int(obj: Mapping[str, Any], key: str, where: str = "") -> int | None:
    if obj.get(key) is None:
        return None
    return get_int(obj, key, where)


def get_int_list(obj: Mapping[str, Any], key: str, where: str = "", default: Any = _MISSING) -> list[int]:
    value = _get(obj, key, where, default)
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise UserError(f"'{_field(where, key)}' must be a list of integers")
    return value


def check_token_tensor(tokens: torch.Tensor, vocab_size: int, what: str) -> None:
    """``check_token_ids`` for an int64 tensor, with the same message."""
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0, 0])
        raise UserError(f"{what}: token id {int(tokens[pos])} at position {pos} is outside the vocabulary [0, {vocab_size})")


def check_token_ids(tokens: list[int], vocab_size: int, what: str) -> None:
    """Every id must index the model's vocabulary: 0 <= id < vocab_size."""
    for pos, tok in enumerate(tokens):
        if tok < 0 or tok >= vocab_size:
            raise UserError(f"{what}: token id {tok} at position {pos} is outside the vocabulary [0, {vocab_size})")
