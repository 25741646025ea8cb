"""The engine protocol's schemas (``protocol.json``, generated from ``workers/engine-protocol.ts``).

Every request's ``args`` are checked against its op's schema before the op runs (a request that
does not follow the protocol is refused with a user error naming the field); the tests check every
result against its op's result schema (``TB_ENGINE_CHECK_RESULTS=1``). The checker knows the JSON
Schema keywords the generator emits, plus ``{"tensor": true}``: a tensor as it travels (a binary
reference ``{"dtype", "shape", "bin"}`` or an inline ``{"dtype", "shape", "data"}``) or, in a result,
a ``torch.Tensor`` before it is encoded. ``default`` is not checked: the agent sends every field, and
``defaults`` reads it for in-process callers that leave fields out (tests, benchmarks).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from .errors import UserError
from .settings import current as settings

_PATH = Path(__file__).with_name("protocol.json")
SCHEMA: dict[str, Any] = json.loads(_PATH.read_text(encoding="utf-8"))
VERSION: int = int(SCHEMA["protocol"])
OPS: dict[str, dict[str, Any]] = SCHEMA["ops"]

#: Known keywords; one the checker does not know stops the engine at import (a generator change).
_KEYWORDS = {"type", "properties", "required", "additionalProperties", "propertyNames", "items", "prefixItems",
             "minItems", "maxItems", "minLength", "enum", "const", "anyOf", "oneOf", "minimum", "maximum",
             "exclusiveMinimum", "exclusiveMaximum", "tensor", "default"}
WIRE_DTYPES = ("float32", "int32", "int64")


class ProtocolViolation(UserError):
    """A request or result that does not follow its op's schema."""


def _check_keywords(schema: Any) -> None:
    if isinstance(schema, dict):
        unknown = set(schema) - _KEYWORDS
        if unknown:
            raise RuntimeError(f"protocol.json uses schema keywords this engine does not check: {sorted(unknown)}")
        for key, value in schema.items():
            if key == "properties":
                for sub in value.values():
                    _check_keywords(sub)
            elif key in ("items", "additionalProperties", "propertyNames") and isinstance(value, dict):
                _check_keywords(value)
            elif key in ("anyOf", "oneOf", "prefixItems"):
                for sub in value:
                    _check_keywords(sub)


for _op in OPS.values():
    _check_keywords(_op["args"])
    _check_keywords(_op["result"])


def defaults(op: str, *path: str) -> dict[str, Any]:
    """The declared default of each field of the object at ``path`` in ``op``'s args, e.g.
    ``defaults("optim_step", "adam")``: the sampling and Adam defaults of queues/contract/params.ts."""
    schema = OPS[op]["args"]
    for key in path:
        schema = schema["properties"][key]
    return {k: v["default"] for k, v in schema["properties"].items() if "default" in v}


def _type_ok(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return False


def _tensor_problem(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return None
    if not isinstance(value, dict) or set(value) not in ({"dtype", "shape", "bin"}, {"dtype", "shape", "data"}):
        return "must be a tensor {dtype, shape, bin} or {dtype, shape, data}"
    if value["dtype"] not in WIRE_DTYPES:
        return f"tensor dtype must be one of {list(WIRE_DTYPES)}, got {value['dtype']!r}"
    shape = value["shape"]
    if not isinstance(shape, list) or not all(_type_ok(d, "integer") and d >= 0 for d in shape):
        return "tensor shape must be a list of non-negative integers"
    if "bin" in value:
        ref = value["bin"]
        if not isinstance(ref, list) or len(ref) != 2 or not all(_type_ok(v, "integer") and v >= 0 for v in ref):
            return "tensor bin must be [offset, nbytes]"
    elif not isinstance(value["data"], list):
        return "tensor data must be a list of numbers"
    return None


def problem(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """The first way ``value`` breaks ``schema`` (``where`` names it), or None."""
    if schema.get("tensor"):
        p = _tensor_problem(value)
        return f"{where}: {p}" if p else None
    for key in ("anyOf", "oneOf"):
        if key in schema:
            found = [problem(value, sub, where) for sub in schema[key]]
            fits = sum(1 for f in found if f is None)
            if fits == 0:
                return next(f for f in found if f)
            if key == "oneOf" and fits > 1:
                return f"{where}: fits {fits} of the alternatives; exactly one must fit"
            return None
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_type_ok(value, n) for n in names):
            return f"{where}: must be {' or '.join(names)}, got {type(value).__name__}"
    if "const" in schema and value != schema["const"]:
        return f"{where}: must be {schema['const']!r}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: must be one of {schema['enum']}, got {value!r}"
    if _type_ok(value, "number"):
        for key, bad in (("minimum", lambda b: value < b), ("maximum", lambda b: value > b),
                         ("exclusiveMinimum", lambda b: value <= b), ("exclusiveMaximum", lambda b: value >= b)):
            if key in schema and bad(schema[key]):
                return f"{where}: {value!r} breaks {key} {schema[key]}"
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        return f"{where}: must not be empty" if schema["minLength"] == 1 else f"{where}: too short"
    if isinstance(value, list):
        return _array_problem(value, schema, where)
    if isinstance(value, dict):
        return _object_problem(value, schema, where)
    return None


def _array_problem(value: list[Any], schema: dict[str, Any], where: str) -> str | None:
    if len(value) < schema.get("minItems", 0):
        return f"{where}: needs at least {schema['minItems']} items"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        return f"{where}: takes at most {schema['maxItems']} items"
    prefix = schema.get("prefixItems", [])
    for i, sub in enumerate(prefix[: len(value)]):
        p = problem(value[i], sub, f"{where}[{i}]")
        if p:
            return p
    items = schema.get("items")
    if isinstance(items, dict):
        for i in range(len(prefix), len(value)):
            p = problem(value[i], items, f"{where}[{i}]")
            if p:
                return p
    return None


def _object_problem(value: dict[str, Any], schema: dict[str, Any], where: str) -> str | None:
    props: dict[str, Any] = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in value:
            return f"{where}: missing required field '{key}'"
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        sub = props.get(key)
        if sub is None:
            if extra is False:
                return f"{where}: unknown field '{key}'"
            sub = extra if isinstance(extra, dict) else None
        if sub is not None:
            p = problem(item, sub, f"{where}.{key}")
            if p:
                return p
    return None


def check_args(op: str, args: dict[str, Any]) -> None:
    """Raises ``ProtocolViolation`` (a user error) when ``args`` break ``op``'s schema; an unknown op passes
    (the engine answers it with its own error)."""
    spec = OPS.get(op)
    if spec is None:
        return
    p = problem(args, spec["args"], "args")
    if p:
        raise ProtocolViolation(f"{op}: {p}")


def check_result(op: str, result: dict[str, Any]) -> None:
    """With ``TB_ENGINE_CHECK_RESULTS=1`` (the tests): raises RuntimeError when a result breaks its schema."""
    if not settings().check_results or op not in OPS:
        return
    p = problem(result, OPS[op]["result"], "result")
    if p:
        raise RuntimeError(f"{op} result breaks the protocol: {p}")
