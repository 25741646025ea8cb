"""The engine: ops by name, and the request -> reply envelope of docs/engine-protocol.md."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import PROTOCOL_VERSION
from .channel import decode_frame
from .device import Placement
from .errors import UserError
from .models import LoraSpec, Registry
from .params import get_obj, get_opt_str, get_str, is_int
from .protocol import check_args, check_result
from .sample import Sampler
from .save import save_sampler
from .settings import current as settings
from .snapshot import SnapshotWriter, snapshot_state
from .state import load_state, save_state
from .cobatch import forward_backward_group
from . import custom_loss
from .train import forward_backward, optim_step

log = logging.getLogger("tinker_engine")

Op = Callable[[dict[str, Any]], dict[str, Any]]
Steps = Generator[None, None, dict[str, Any]]
SteppedOp = Callable[[dict[str, Any]], Steps]



def device_memory(device: torch.device, name: str, reset_peak: bool, release: bool = False) -> dict[str, Any]:
    """The ``memory`` op: device memory in bytes (CUDA; zeros on the CPU); ``reset_peak`` restarts the peak
    count; ``release`` first gives the allocator's cached blocks back to the device (a GPU turn handed over
    to another engine on the GPU: what the models and their optimizer state hold stays). No garbage
    collection: the ops free their tensors when they return, and a full collection costs about a second
    in this process (measured on the CPU, test/e2e/gpu-turns.test.ts), at every hand-over."""
    if device.type != "cuda":
        return {"device": name, "allocated_bytes": 0, "reserved_bytes": 0, "max_allocated_bytes": 0}
    if release:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    result = {"device": name, "allocated_bytes": torch.cuda.memory_allocated(device),
              "reserved_bytes": torch.cuda.memory_reserved(device),
              "max_allocated_bytes": torch.cuda.max_memory_allocated(device)}
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return result

class Task:
    """One request in progress: ``step()`` advances it and returns its reply once it is done.

    Sample ops add their requests to the base model's generating batch and are done when those
    requests are (``Engine.advance`` runs the decode steps); every other op finishes in its first
    step.
    """

    def __init__(self, engine: Engine, request_id: Any, op: str, subject: str, start: float,
                 steps: Steps | None, reply: dict[str, Any] | None) -> None:
        self._engine = engine
        self.request_id = request_id
        self.op = op
        self.subject = subject
        self.start = start
        self._steps = steps
        self._reply = reply

    def step(self) -> dict[str, Any] | None:
        if self._reply is not None:
            return self._reply
        assert self._steps is not None
        try:
            next(self._steps)
            return None
        except StopIteration as done:
            try:
                check_result(self.op, done.value)
                self._reply = ok_reply(self.request_id, self.op, self.subject, self.start, done.value)
            except Exception as exc:  # noqa: BLE001
                self._reply = failed_reply(self.request_id, self.op, self.subject, self.start, exc)
        except Exception as exc:  # noqa: BLE001
            self._reply = failed_reply(self.request_id, self.op, self.subject, self.start, exc)
        return self._reply


class Engine:
    def __init__(self, placement: Placement, sampler_cache_size: int | None = None) -> None:
        if sampler_cache_size is None:
            sampler_cache_size = settings().sampler_cache
        self.placement = placement
        self.registry = Registry(placement=placement, sampler_cache_size=max(1, sampler_cache_size))
        self.sampler = Sampler(self.registry)
        self.snapshots = SnapshotWriter()
        self.ops: dict[str, Op] = {
            "hello": self.hello,
            "load_base": self.load_base,
            "create_model": self.create_model,
            # loss_fn 'custom': a server-side custom loss, its graph rebuilt from the allowlist (custom_loss.py).
            "forward_backward": lambda args: (custom_loss.forward_backward if args.get("loss_fn") == custom_loss.LOSS_FN
                                              else forward_backward)(self.registry, args),
            "forward_backward_group": lambda args: forward_backward_group(self.registry, args),
            "optim_step": lambda args: optim_step(self.registry, args),
            "save_sampler": lambda args: save_sampler(self.registry, args),
            "save_state": lambda args: save_state(self.registry, args),
            "snapshot_state": lambda args: snapshot_state(self.registry, self.snapshots, args),
            "load_state": lambda args: load_state(self.registry, args),
            "sample": lambda args: self.sampler.run_to_end(self.sampler.sample_steps(args)),
            "sample_batch": lambda args: self.sampler.run_to_end(self.sampler.sample_batch_steps(args)),
            "unload_model": self.unload_model,
            "memory": self.memory,
        }
        # Ops that can run a step at a time (the request loop interleaves other ops between steps).
        self.stepped_ops: dict[str, SteppedOp] = {
            "sample": self.sampler.sample_steps,
            "sample_batch": self.sampler.sample_batch_steps,
        }

    # --- ops that only touch the registry -------------------------------------------------------

    def hello(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"protocol": PROTOCOL_VERSION, "engine": "torch", "device": self.placement.device_name,
                "torch": torch.__version__}

    def load_base(self, args: dict[str, Any]) -> dict[str, Any]:
        # ``dtype`` (the preset's): the base weights' dtype for this model; else the engine's (TB_ENGINE_DTYPE).
        base = self.registry.load_base(get_str(args, "name"), get_str(args, "path"), get_opt_str(args, "dtype"))
        return base.info()

    def create_model(self, args: dict[str, Any]) -> dict[str, Any]:
        lora = LoraSpec.parse(get_obj(args, "lora"))
        model = self.registry.create_model(get_str(args, "model_id"), get_str(args, "base_model"), lora)
        return {"model_id": model.model_id, "lora_rank": model.lora.rank}

    def memory(self, args: dict[str, Any]) -> dict[str, Any]:
        return device_memory(self.placement.device, self.placement.device_name, bool(args.get("reset_peak")),
                             bool(args.get("release")))

    def unload_model(self, args: dict[str, Any]) -> dict[str, Any]:
        model_id = get_str(args, "model_id")
        self.registry.unload_model(model_id)
        return {"model_id": model_id}

    # --- envelope -------------------------------------------------------------------------------

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run one op; raises UserError or any other exception (for in-process use and tests)."""
        handler = self.ops.get(op)
        if handler is None:
            raise KeyError(f"unknown op '{op}'; known: {', '.join(self.ops)}")
        result = handler(args)
        check_result(op, result)
        return result

    @property
    def busy(self) -> bool:
        """Some sample batch has decode steps to run."""
        return self.sampler.busy

    def advance(self) -> None:
        """One decode step of every generating batch (failures reach the requests' replies)."""
        self.sampler.advance()

    def reply(self, body: bytes | bytearray) -> dict[str, Any]:
        """The reply to one request frame, run to the end; never raises for a bad request or a failing op."""
        return self.start(body, stepped=False).step() or {}

    def start(self, body: bytes | bytearray, stepped: bool = True) -> Task:
        """Parse one request frame and begin it; ``Task.step`` runs it (never raises)."""
        f = Frame()
        start = time.perf_counter()
        try:
            parse_frame(body, f)
            if f.op == "sample_batch" and isinstance(f.args.get("requests"), list):
                f.subject += f" requests={len(f.args['requests'])}"
            if f.op == "forward_backward_group" and isinstance(f.args.get("members"), list):
                f.subject += f" members={len(f.args['members'])}"
            if f.op in ("forward_backward", "forward_backward_group", "optim_step"):
                self.registry.trained_since_release = True
            if stepped and f.op in self.stepped_ops:
                return Task(self, f.id, f.op, f.subject, start, self.stepped_ops[f.op](f.args), None)
            result = self.call(f.op, f.args)
            return Task(self, f.id, f.op, f.subject, start, None, ok_reply(f.id, f.op, f.subject, start, result))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reply; the engine keeps serving
            return Task(self, f.id, f.op, f.subject, start, None, failed_reply(f.id, f.op, f.subject, start, exc))


@dataclass
class Frame:
    """What one request frame said, as far as it was read (a malformed frame keeps the rest default)."""
    id: Any = None
    op: str = "?"
    subject: str = ""
    args: dict[str, Any] = field(default_factory=dict)


def parse_frame(body: bytes | bytearray, f: Frame) -> None:
    """Fills ``f`` from one request frame ``{"id", "op", "args"}`` (its tensors decoded); raises ValueError for
    a malformed frame and ``ProtocolViolation`` (a user error) for args that break the op's schema."""
    request = decode_frame(body)
    if not isinstance(request, dict):
        raise ValueError("a request must be a JSON object")
    f.id = request.get("id")
    if not is_int(f.id):
        raise ValueError("request id must be an integer")
    op = request.get("op")
    if not isinstance(op, str):
        raise ValueError("request op must be a string")
    f.op = op
    args = request.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError("request args must be an object")
    f.args = args
    check_args(op, args)
    if args.get("model_id"):
        f.subject = f"model_id={args['model_id']}"
    elif args.get("base_model") or args.get("name"):
        f.subject = f"base={args.get('base_model') or args.get('name')}"


def ok_reply(request_id: Any, op: str, subject: str, start: float, result: dict[str, Any]) -> dict[str, Any]:
    _log(op, subject, start, "ok")
    return {"id": request_id, "ok": True, "result": result}


def failed_reply(request_id: Any, op: str, subject: str, start: float, exc: Exception) -> dict[str, Any]:
    """A failure's reply: a ``UserError`` is a ``user`` error, any other exception a ``server`` one."""
    if isinstance(exc, UserError):
        _log(op, subject, start, f"user_error: {exc}")
        return {"id": request_id, "ok": False, "error": {"category": "user", "message": str(exc)}}
    log.error("op=%s failed:\n%s", op, "".join(traceback.format_exception(exc)).rstrip())
    _log(op, subject, start, "server_error")
    if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return {"id": request_id, "ok": False,
            "error": {"category": "server", "message": f"{type(exc).__name__}: {message}"}}


def reply(call: Callable[[str, dict[str, Any]], dict[str, Any]], body: bytes | bytearray) -> dict[str, Any]:
    """The reply to one request frame, running it with ``call(op, args)``; never raises.

    Shared by every engine speaking this protocol (torch, verl): a ``UserError`` becomes a
    ``user`` error reply, any other exception a ``server`` one; the engine keeps serving.
    """
    f = Frame()
    start = time.perf_counter()
    try:
        parse_frame(body, f)
        return ok_reply(f.id, f.op, f.subject, start, call(f.op, f.args))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reply; the engine keeps serving
        return failed_reply(f.id, f.op, f.subject, start, exc)


def _log(op: str, subject: str, start: float, outcome: str) -> None:
    ms = (time.perf_counter() - start) * 1000.0
    log.info("op=%s %s ms=%.1f %s", op, subject or "model_id=-", ms, outcome)
