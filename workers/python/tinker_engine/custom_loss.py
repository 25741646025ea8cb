"""Server-side custom losses (``ServiceClient.create_custom_loss``, SDK 0.38): a traced torch.fx graph,
sent as plain data, rebuilt node by node from an allowlist and run per datum in one forward/backward.

Nothing the client sent is executed as Python, unpickled or evaluated. ``rebuild`` reads the graph's
nodes (``{op, name, target, args, kwargs}``, the SDK's ``CustomLossGraph``) and maps each target to a
callable only through ``queues/contract/custom-loss.json``: ``torch.*``, ``torch.nn.functional.*``,
``math.*`` and ``operator.*`` functions named there, the ``torch.Tensor`` methods named there, and
``getattr`` for a few tensor attributes. Anything else (imports, ``get_attr``/``call_module`` nodes,
dunder names, file or OS calls, functions outside the list, constants past the bounds, references to
nodes not defined before) is a ``UserError`` naming the node. At run time every tensor a node makes is
bounded (``max_elements``), checked before the call where the size is in the arguments.

``forward_backward`` has the semantics of the SDK's ``run_loss_handle``: the graph runs once per datum on
``(logprobs, *inputs)`` (the datum's target logprobs, then each declared ``loss_fn_inputs`` key: one of
rank 1 or 2 has the datum's rows, one of rank 0 is a 0-d tensor, as the SDK's ``to_torch()`` makes it), its
scalar losses are summed over the datums, metrics ``custom/<name>:sum`` are summed and ``:mean`` ones
averaged over the request's datums. The gradient flows from the summed loss through the logprobs into
the adapter, as the client-side path's surrogate ``weights = -dC/dlogprobs`` would send it.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional

from .errors import UserError
from .logprobs import target_logprobs
from .losses import CATALOGUE_FILE
from .models import Registry
from .params import check_token_tensor, get_bool, get_obj, get_str, is_int
from .rollback import check_grad_max_abs, check_losses, grad_max_abs
from .settings import current as settings
from .tensors import tensor_from_json, wire

# The allowlist and bounds, one file shared with the API (queues/contract/custom-loss.ts reads it too).
OPS_FILE = Path(CATALOGUE_FILE).with_name("custom-loss.json")
OPS: dict[str, Any] = json.loads(OPS_FILE.read_text())

LOSS_FN: str = OPS["loss_fn"]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_NODE_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in OPS["dtypes"]}
_LAYOUTS: dict[str, Any] = {name: getattr(torch, name) for name in OPS["layouts"]}
_MEMORY_FORMATS: dict[str, Any] = {name: getattr(torch, name) for name in OPS["memory_formats"]}
_MODULES: dict[str, Any] = {"torch.nn.functional": torch.nn.functional, "torch": torch, "math": math, "operator": operator}


def _resolve_function(target: str) -> Callable[..., Any]:
    """The callable an allowlisted function name stands for: an attribute of one of four modules."""
    if target == "getattr":
        return _tensor_attribute
    for prefix, module in _MODULES.items():
        if target.startswith(prefix + "."):
            attr = target[len(prefix) + 1:]
            if _NAME.fullmatch(attr) and not attr.startswith("_"):
                fn = getattr(module, attr)
                if callable(fn):
                    return fn
    raise RuntimeError(f"{OPS_FILE}: function {target!r} does not resolve to a callable")


def _tensor_attribute(obj: Any, name: str) -> Any:
    if not isinstance(obj, torch.Tensor):
        raise UserError(f"getattr reads attributes of tensors only, got {type(obj).__name__}")
    return getattr(obj, name)


# Every name of the allowlist resolved once at import: a name that does not resolve is an error here.
FUNCTIONS: dict[str, Callable[..., Any]] = {name: _resolve_function(name) for name in OPS["functions"]}
METHODS: frozenset[str] = frozenset(OPS["methods"])
for _m in METHODS:
    if _m.startswith("_") or not callable(getattr(torch.Tensor, _m, None)):
        raise RuntimeError(f"{OPS_FILE}: method {_m!r} is not a public torch.Tensor method")
ATTRIBUTES: frozenset[str] = frozenset(OPS["attributes"])
CREATORS: dict[str, str] = OPS["creators"]


# --- the rebuilt graph ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """A reference to an earlier node's value (its index in the graph)."""

    index: int


@dataclass(frozen=True)
class Const:
    """A torch constant (dtype, layout, memory format) or the engine's device."""

    kind: str
    value: Any


@dataclass(frozen=True)
class Node:
    name: str
    op: str  # call_function | call_method
    target: str
    fn: Callable[..., Any] | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class CustomLoss:
    """A rebuilt custom loss: its inputs (``logprobs`` first, with ranks) and its call nodes in order."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[Node, ...]
    loss: Any
    metrics: dict[str, Any]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.inputs[1:])


def _refuse(loss: str, node: str, why: str) -> UserError:
    return UserError(f"custom loss '{loss}': node '{node}' {why}")


class _Decoder:
    """Decodes one node's encoded arguments (the SDK's ``_encode_arg`` forms) within the bounds."""

    def __init__(self, loss: str, names: dict[str, int]) -> None:
        self.loss = loss
        self.names = names
        self.leaves = 0
        self.node = "?"

    def refuse(self, why: str) -> UserError:
        return _refuse(self.loss, self.node, why)

    def decode(self, value: Any, depth: int = 0) -> Any:
        if depth > OPS["max_arg_depth"]:
            raise self.refuse(f"nests its arguments deeper than {OPS['max_arg_depth']}")
        self.leaves += 1
        if self.leaves > OPS["max_list_items"] * 4:
            raise self.refuse(f"has more than {OPS['max_list_items'] * 4} constants and references")
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if abs(value) > OPS["max_int_abs"]:
                raise self.refuse(f"has the integer constant {value}, past the bound {OPS['max_int_abs']}")
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                raise self.refuse("has a non-finite float written as a number")
            return value
        if isinstance(value, str):
            if len(value) > OPS["max_string_chars"]:
                raise self.refuse(f"has a string constant longer than {OPS['max_string_chars']} characters")
            return value
        if isinstance(value, list):
            return [self.decode(v, depth + 1) for v in self._items(value)]
        if not isinstance(value, dict) or len(value) != 1:
            raise self.refuse(f"has an argument of an unknown form: {type(value).__name__}")
        (kind, body), = value.items()
        if kind == "ref":
            if not isinstance(body, str) or body not in self.names:
                shown = body[:64] if isinstance(body, str) else repr(body)[:64]
                raise self.refuse(f"refers to '{shown}', which is not a node defined before it")
            return Ref(self.names[body])
        if kind == "tuple":
            return tuple(self.decode(v, depth + 1) for v in self._items(body))
        if kind == "dict":
            if not isinstance(body, dict) or len(body) > OPS["max_list_items"]:
                raise self.refuse(f"has a dict argument that is not an object of at most {OPS['max_list_items']} keys")
            for key in body:
                if len(key) > OPS["max_string_chars"]:
                    raise self.refuse(f"has a dict key longer than {OPS['max_string_chars']} characters")
            return {key: self.decode(v, depth + 1) for key, v in body.items()}
        if kind == "slice":
            items = self._items(body)
            if len(items) != 3:
                raise self.refuse("has a slice that is not [start, stop, step]")
            return slice(*(self.decode(v, depth + 1) for v in items))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "float":
            if body not in ("inf", "-inf", "nan"):
                raise self.refuse(f"has the float {str(body)[:16]!r}; only inf, -inf and nan are written as text")
            return float(body)
        if kind == "dtype":
            if body not in _DTYPES:
                raise self.refuse(f"names dtype {str(body)[:32]!r}; allowed: {', '.join(_DTYPES)}")
            return _DTYPES[body]
        if kind == "layout":
            if body not in _LAYOUTS:
                raise self.refuse(f"names layout {str(body)[:32]!r}; allowed: {', '.join(_LAYOUTS)}")
            return _LAYOUTS[body]
        if kind == "memory_format":
            if body not in _MEMORY_FORMATS:
                raise self.refuse(f"names memory format {str(body)[:32]!r}; allowed: {', '.join(_MEMORY_FORMATS)}")
            return _MEMORY_FORMATS[body]
        if kind == "device":
            if not isinstance(body, str) or not re.fullmatch(r"cpu|cuda(:[0-9]{1,2})?", body):
                raise self.refuse(f"names device {str(body)[:32]!r}")
            return Const("device", None)
        raise self.refuse(f"has an argument of unknown kind '{str(kind)[:32]}'")

    def _items(self, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise self.refuse("has a malformed list argument")
        if len(value) > OPS["max_list_items"]:
            raise self.refuse(f"has a list of {len(value)} items; at most {OPS['max_list_items']}")
        return value


def _refs(value: Any) -> Iterator[Ref]:
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _refs(v)


def rebuild(name: Any, inputs: Any, graph: Any) -> CustomLoss:
    """The custom loss ``graph`` rebuilt from the allowlist, or a ``UserError`` naming what is refused."""
    if not isinstance(name, str) or not name or len(name) > OPS["max_name_chars"]:
        raise UserError(f"custom loss: name must be a string of 1 to {OPS['max_name_chars']} characters")
    declared = _parse_inputs(name, inputs)
    if not isinstance(graph, dict) or graph.get("format", 1) != 1 or not isinstance(graph.get("nodes"), list):
        raise UserError(f"custom loss '{name}': graph must be {{format: 1, nodes: [...]}}")
    raw_nodes = graph["nodes"]
    if len(raw_nodes) > OPS["max_nodes"]:
        raise UserError(f"custom loss '{name}': the graph has {len(raw_nodes)} nodes; at most {OPS['max_nodes']}")
    names: dict[str, int] = {}
    nodes: list[Node] = []
    decoder = _Decoder(name, names)
    output: Any = None
    placeholders = 0
    for raw in raw_nodes:
        if not isinstance(raw, dict):
            raise UserError(f"custom loss '{name}': every node must be an object")
        node_name, op, target = raw.get("name"), raw.get("op"), raw.get("target")
        if not isinstance(node_name, str) or not _NAME.fullmatch(node_name) or len(node_name) > OPS["max_name_chars"]:
            shown = node_name[:64] if isinstance(node_name, str) else repr(node_name)[:64]
            raise UserError(f"custom loss '{name}': node name {shown!r} must be an identifier of at most "
                            f"{OPS['max_name_chars']} characters")
        decoder.node = node_name
        if node_name in names:
            raise _refuse(name, node_name, "is defined twice")
        if op not in _NODE_OPS:
            raise _refuse(name, node_name, f"has op {str(op)[:32]!r}; a graph node is one of {', '.join(_NODE_OPS)}")
        if not isinstance(target, str) or len(target) > 128:
            raise _refuse(name, node_name, "has a target that is not a string of at most 128 characters")
        if output is not None:
            raise _refuse(name, node_name, "comes after the output node")
        args, kwargs = raw.get("args", []), raw.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise _refuse(name, node_name, "must have args as a list and kwargs as an object")
        if len(args) + len(kwargs) > OPS["max_args_per_node"]:
            raise _refuse(name, node_name, f"has more than {OPS['max_args_per_node']} arguments")
        if op == "placeholder":
            if placeholders >= len(declared) or nodes:
                raise _refuse(name, node_name, "is a placeholder the declared inputs do not have (placeholders come first, one per input)")
            if target != declared[placeholders][0]:
                raise _refuse(name, node_name, f"is the placeholder of '{target[:64]}', but input {placeholders} is "
                                               f"'{declared[placeholders][0]}'")
            names[node_name] = len(names)
            placeholders += 1
            continue
        if op == "get_attr":
            raise _refuse(name, node_name, f"reads the attribute '{target[:64]}' of the traced module (get_attr); "
                                           "a custom loss may only read logprobs and its declared inputs")
        if op == "call_module":
            raise _refuse(name, node_name, f"calls the module '{target[:64]}' (call_module); torch.nn modules are not allowed")
        if placeholders != len(declared):
            raise UserError(f"custom loss '{name}': the graph has {placeholders} placeholders but {len(declared)} declared inputs")
        if op == "output":
            if len(args) != 1:
                raise _refuse(name, node_name, "(output) must have one argument, (loss, metrics)")
            output = decoder.decode(args[0])
            continue
        nodes.append(_call_node(name, node_name, op, target, [decoder.decode(a) for a in args],
                                {k: decoder.decode(v) for k, v in _kwargs(name, node_name, kwargs).items()}))
        names[node_name] = len(names)
    if output is None:
        raise UserError(f"custom loss '{name}': the graph has no output node")
    loss, metrics = _parse_output(name, output)
    return CustomLoss(name, declared, tuple(nodes), loss, metrics)


def _parse_inputs(name: str, inputs: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, list) or not inputs or len(inputs) > OPS["max_inputs"]:
        raise UserError(f"custom loss '{name}': inputs must list 1 to {OPS['max_inputs']} inputs, logprobs first")
    out: list[tuple[str, int]] = []
    for i, item in enumerate(inputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item.get("rank") not in (0, 1, 2):
            raise UserError(f"custom loss '{name}': inputs[{i}] must be {{name, rank}} with rank 0, 1 or 2")
        if not _INPUT_NAME.fullmatch(item["name"]):
            raise UserError(f"custom loss '{name}': input name {item['name'][:64]!r} must be lowercase letters, digits and underscores")
        out.append((item["name"], int(item["rank"])))
    if out[0][0] != "logprobs" or out[0][1] == 0:
        raise UserError(f"custom loss '{name}': the first input must be logprobs, of rank 1 or 2")
    if len({n for n, _ in out}) != len(out):
        raise UserError(f"custom loss '{name}': input names must be distinct")
    for n, _ in out[1:]:
        if n == "target_tokens":
            raise UserError(f"custom loss '{name}': target_tokens is not a loss input (logprobs are its logprobs)")
    return tuple(out)


def _kwargs(loss: str, node: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    for key, value in kwargs.items():
        if not isinstance(key, str) or not _NAME.fullmatch(key) or key.startswith("_"):
            raise _refuse(loss, node, f"has the keyword argument {str(key)[:64]!r}")
        if key in OPS["refused_kwargs"]:
            raise _refuse(loss, node, f"passes {key}=, which would write into a tensor")
        if key == "inplace" and value is not False:
            raise _refuse(loss, node, "passes inplace=True; custom losses may not modify tensors in place")
    return kwargs


def _dunder(target: str) -> bool:
    return any(part.startswith("_") for part in target.split("."))


def _call_node(loss: str, node: str, op: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> Node:
    if _dunder(target):
        raise _refuse(loss, node, f"names '{target[:64]}'; names starting with an underscore (dunders, private "
                                  "attributes) are not allowed")
    if op == "call_function":
        fn = FUNCTIONS.get(target)
        if fn is None:
            raise _refuse(loss, node, f"calls '{target[:64]}', which is not an allowed operation (torch tensor math, "
                                      "math and operator functions listed in queues/contract/custom-loss.json)")
        if target == "getattr":
            if len(args) != 2 or kwargs or not isinstance(args[0], Ref) or not isinstance(args[1], str):
                raise _refuse(loss, node, "(getattr) must read one attribute of a node: getattr(node, 'name')")
            if args[1] not in ATTRIBUTES:
                raise _refuse(loss, node, f"reads the attribute '{args[1][:64]}'; allowed: {', '.join(sorted(ATTRIBUTES))}")
        return Node(node, op, target, fn, tuple(args), kwargs)
    # call_method: the method of the first argument, which is a node's value.
    if target not in METHODS:
        raise _refuse(loss, node, f"calls the method '{target[:64]}', which is not an allowed operation")
    if not args or not isinstance(args[0], Ref):
        raise _refuse(loss, node, f"calls the method '{target}' on something that is not a node")
    if target == "to" and not all(isinstance(a, torch.dtype) for a in args[1:]) or target == "to" and set(kwargs) - {"dtype"}:
        raise _refuse(loss, node, "calls to() with something other than a dtype")
    return Node(node, op, target, None, tuple(args), kwargs)


def _parse_output(loss: str, output: Any) -> tuple[Any, dict[str, Any]]:
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        raise UserError(f"custom loss '{loss}': the output must be (loss, metrics)")
    value, metrics = output
    if not isinstance(value, Ref):
        raise UserError(f"custom loss '{loss}': the loss must be a node's value")
    if not isinstance(metrics, dict):
        raise UserError(f"custom loss '{loss}': the metrics must be a dict")
    for key, m in metrics.items():
        if not _METRIC_KEY.fullmatch(key):
            raise UserError(f"custom loss '{loss}': metric {key[:80]!r} must be named custom/<name>:sum or custom/<name>:mean")
        if not isinstance(m, Ref):
            raise UserError(f"custom loss '{loss}': metric {key!r} must be a node's value")
    return value, metrics


# --- running it ---------------------------------------------------------------------------------------


def _numel(size: Any) -> int | None:
    """The element count of a size given as ints or a list/tuple of ints (None if not one)."""
    if isinstance(size, torch.Size):
        size = tuple(size)
    if isinstance(size, (list, tuple)) and len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    if isinstance(size, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in size):
        return math.prod(max(d, 0) for d in size)
    return None


def _count(data: Any) -> int:
    if isinstance(data, (list, tuple)):
        return sum(_count(d) for d in data)
    return data.numel() if isinstance(data, torch.Tensor) else 1


def _requested(kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], method: bool) -> int | None:
    """The elements a creator call asks for, from its arguments (None when they do not say)."""
    rest = args[1:] if method else args
    if kind == "size_args":
        return _numel(kwargs.get("size", rest))
    if kind == "size_first":
        return _numel(kwargs.get("size", rest[:1]))
    if kind == "times_self":
        times = _numel(rest)
        return None if times is None else times * args[0].numel()
    if kind == "data":
        return _count(rest[0] if rest else kwargs.get("data"))
    if kind == "steps":
        steps = rest[2] if len(rest) > 2 else kwargs.get("steps")
        return int(steps) if isinstance(steps, (int, float)) else None
    if kind == "range":
        nums = [float(x) for x in rest if isinstance(x, (int, float, torch.Tensor)) and not isinstance(x, bool)]
        start, end, step = (0.0, nums[0], 1.0) if len(nums) == 1 else (nums + [1.0])[:3] if nums else (0.0, 0.0, 1.0)
        if step == 0 or not all(math.isfinite(v) for v in (start, end, step)):
            return None
        return max(0, math.ceil((end - start) / step))
    raise RuntimeError(f"{OPS_FILE}: unknown creator kind {kind!r}")


def _check_call(loss: str, node: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuses, before it runs, a call that would make a tensor past ``max_elements``."""
    limit = OPS["max_elements"]
    kind = CREATORS.get(node.target)
    if kind is not None:
        n = _requested(kind, args, kwargs, node.op == "call_method")
        if n is None or n > limit:
            raise _refuse(loss, node.name, f"({node.target}) asks for {'an unknown number of' if n is None else n} "
                                          f"elements; at most {limit}")
    tensors = [a.shape for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if len(tensors) > 1:
        try:
            shape = torch.broadcast_shapes(*tensors)
        except RuntimeError:
            return
        if math.prod(shape) > limit:
            raise _refuse(loss, node.name, f"({node.target}) broadcasts to {list(shape)}, past {limit} elements")
    if node.target in ("operator.pow", "torch.pow", "pow") and len(args) == 2:
        base, exp = args
        if isinstance(exp, int) and isinstance(base, int) and abs(exp) > OPS["max_pow_exponent_abs"]:
            raise _refuse(loss, node.name, f"raises an integer to the power {exp}; at most {OPS['max_pow_exponent_abs']}")


def _check_value(loss: str, node: Node, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() > OPS["max_elements"]:
            raise _refuse(loss, node.name, f"({node.target}) made {value.numel()} elements; at most {OPS['max_elements']}")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > OPS["max_int_result_abs"]:
        raise _refuse(loss, node.name, f"({node.target}) made an integer past {OPS['max_int_result_abs']}")


def _resolve(value: Any, env: list[Any], device: torch.device) -> Any:
    if isinstance(value, Ref):
        return env[value.index]
    if isinstance(value, Const):
        return device
    if isinstance(value, list):
        return [_resolve(v, env, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env, device) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env, device) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_resolve(value.start, env, device), _resolve(value.stop, env, device), _resolve(value.step, env, device))
    return value


def run(loss: CustomLoss, values: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss on one datum's values (logprobs, then each declared input): (scalar loss, metrics)."""
    device = values[0].device
    env: list[Any] = list(values)
    for node in loss.nodes:
        args = _resolve(node.args, env, device)
        kwargs = _resolve(node.kwargs, env, device)
        _check_call(loss.name, node, args, kwargs)
        try:
            if node.op == "call_method":
                if not isinstance(args[0], torch.Tensor):
                    raise UserError(f"the method '{node.target}' is called on a {type(args[0]).__name__}, not a tensor")
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                assert node.fn is not None
                value = node.fn(*args, **kwargs)
        except UserError as exc:
            raise _refuse(loss.name, node.name, f"({node.target}) failed: {exc}") from None
        except (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError) as exc:
            raise _refuse(loss.name, node.name, f"({node.target}) failed: {str(exc)[:300]}") from None
        _check_value(loss.name, node, value)
        env.append(value)
    result = env[loss.loss.index]
    if not isinstance(result, torch.Tensor) or result.ndim != 0:
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise UserError(f"custom loss '{loss.name}' must return a scalar loss, got {shape}")
    metrics: dict[str, torch.Tensor] = {}
    for key, ref in loss.metrics.items():
        m = env[ref.index]
        if not isinstance(m, torch.Tensor) or m.numel() != 1:
            raise UserError(f"custom loss '{loss.name}': metric {key!r} must be a one-element tensor")
        metrics[key] = m
    return result, metrics


# --- forward_backward with a custom loss ------------------------------------------------------------


@dataclass
class _Datum:
    index: int
    tokens: torch.Tensor
    targets: torch.Tensor
    values: list[torch.Tensor]  # the declared inputs after logprobs, in order


def _parse_datum(i: int, raw: Any, loss: CustomLoss, vocab_in: int, vocab_out: int, context: int | None) -> _Datum:
    where = f"datum {i}"
    if not isinstance(raw, dict) or not isinstance(raw.get("loss_fn_inputs"), dict):
        raise UserError(f"{where}: must be an object with tokens and loss_fn_inputs")
    raw_tokens = raw.get("tokens")
    if isinstance(raw_tokens, list) and raw_tokens and all(is_int(t) for t in raw_tokens):
        tokens = torch.tensor(raw_tokens, dtype=torch.int64)
    else:
        tokens = tensor_from_json(raw_tokens, f"{where} tokens")
    if tokens.dtype != torch.int64 or tokens.dim() != 1 or tokens.shape[0] == 0:
        raise UserError(f"{where}: tokens must be a non-empty int64 tensor of shape (N,)")
    n = int(tokens.shape[0])
    if context and n > context:
        raise UserError(f"{where}: {n} tokens exceed the model's context length {context}")
    check_token_tensor(tokens, vocab_in, f"{where} tokens")
    inputs = raw["loss_fn_inputs"]
    if "target_tokens" not in inputs:
        raise UserError(f"{where}: loss_fn_inputs['target_tokens'] is required")
    targets = tensor_from_json(inputs["target_tokens"], f"{where} target_tokens")
    rank = loss.inputs[0][1]
    if targets.dtype != torch.int64 or targets.dim() != rank or targets.shape[0] != n or targets.numel() == 0:
        raise UserError(f"{where}: target_tokens must be int64 of rank {rank} (logprobs' declared rank) with "
                        f"{n} rows, got {targets.dtype} {list(targets.shape)}")
    if bool(((targets < 0) | (targets >= vocab_out)).any()):
        raise UserError(f"{where}: a target token id is outside the vocabulary [0, {vocab_out})")
    values = []
    for name, r in loss.inputs[1:]:
        if name not in inputs:
            raise UserError(f"{where}: custom loss '{loss.name}' reads loss_fn_inputs['{name}'], which the datum lacks")
        t = tensor_from_json(inputs[name], f"{where} {name}")
        if r == 0:
            if t.numel() != 1:
                raise UserError(f"{where}: {name} is declared rank 0 (a scalar) but has {t.numel()} elements")
            t = t.reshape(())
        elif t.dim() != r or t.shape[0] != n:
            raise UserError(f"{where}: {name} is declared rank {r} with {n} rows, got shape {list(t.shape)}")
        values.append(t)
    return _Datum(i, tokens, targets, values)


def _micro_batches(datums: list[_Datum], budget: int) -> Iterator[list[_Datum]]:
    """Consecutive groups whose padded size (count x longest) stays within ``budget`` tokens."""
    batch: list[_Datum] = []
    longest = 0
    for d in datums:
        n = d.tokens.shape[0]
        if batch and max(longest, n) * (len(batch) + 1) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(d)
        longest = max(longest, n)
    if batch:
        yield batch


def forward_backward(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    """``forward_backward`` (or ``forward``) with ``loss_fn`` ``custom``: the graph in ``args['custom_loss']``
    ({name, inputs, graph}, resolved by the API from the loss id) rebuilt here, then one forward and one
    backward over the request's datums. Every datum is checked before the model is touched; if anything
    fails midway the gradients are restored to what they were before the call."""
    model = registry.model(get_str(args, "model_id"))
    spec = get_obj(args, "custom_loss")
    loss = rebuild(spec.get("name"), spec.get("inputs"), spec.get("graph"))
    forward_only = get_bool(args, "forward_only", default=False)
    raw_data = args.get("data")
    if not isinstance(raw_data, list) or not raw_data:
        raise UserError("data must be a non-empty list of datums")
    base = model.base
    datums = [_parse_datum(i, d, loss, base.input_vocab_size, base.vocab_size, base.max_context_length)
              for i, d in enumerate(raw_data)]

    base.activate(model.adapter, trainable=True)
    flat = model.flat
    saved = None if forward_only else flat.grads_saved()
    outputs: list[torch.Tensor] = []
    total: torch.Tensor | None = None
    sums: dict[str, float] = {}
    try:
        for batch in _micro_batches(datums, settings().max_batch_tokens):
            batch_total, batch_outputs = _run_batch(base, loss, batch, sums, None if forward_only else flat.weight)
            outputs.extend(batch_outputs)
            total = batch_total if total is None else total + batch_total
    except BaseException:
        if not forward_only:
            flat.restore_grads(saved)
        raise
    if not forward_only:
        flat.pending = True
    metrics = {key: value / len(datums) if key.endswith(":mean") else value for key, value in sums.items()}
    assert total is not None
    return {
        "loss_fn_outputs": [{"logprobs": wire(lp)} for lp in outputs],
        "metrics": {"loss:sum": float(total), **metrics},
    }


def _run_batch(base: Any, loss: CustomLoss, batch: list[_Datum], sums: dict[str, float],
               flat_weight: torch.nn.Parameter | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One micro-batch: forward, the graph per datum, the losses summed in datum order, backward."""
    device = base.device
    longest = max(d.tokens.shape[0] for d in batch)
    ids = torch.zeros((len(batch), longest), dtype=torch.int64)
    for row, d in enumerate(batch):
        ids[row, : d.tokens.shape[0]] = d.tokens
    with torch.set_grad_enabled(flat_weight is not None):
        # Right-padded rows under causal attention: no real position sees a pad (as train.py runs them).
        logits = base.hf(input_ids=ids.to(device), use_cache=False).logits
        lps = [target_logprobs(logits[row, : d.tokens.shape[0]], d.targets.to(device)) for row, d in enumerate(batch)]
        del logits
        losses: list[torch.Tensor] = []
        for d, lp in zip(batch, lps):
            value, metrics = run(loss, [lp, *(v.to(device) for v in d.values)])
            losses.append(value)
            for key, m in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(m.detach().reshape(()).item())
        total = losses[0]
        for value in losses[1:]:
            total = total + value
        indices = [d.index for d in batch]
        check_losses(indices, [v.detach().cpu() for v in losses], [lp.detach().cpu() for lp in lps])
        if flat_weight is not None:
            if not total.requires_grad:
                raise UserError(f"custom loss '{loss.name}': the loss does not depend on logprobs, so it has no gradient")
            total.backward()
            check_grad_max_abs(indices, float(grad_max_abs([flat_weight])))
    return total.detach().float(), [lp.detach().cpu().reshape(d.targets.shape) for d, lp in zip(batch, lps)]
