"""The engine: ops by name, and the request -> reply envelope of docs/engine-protocol.md."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from . import PROTOCOL_VERSION
from .device import Placement
from .errors import UserError
from .models import LoraSpec, Registry
from .params import get_obj, get_str, is_int
from .sample import sample
from .save import save_sampler
from .state import load_state, save_state
from .train import forward_backward, optim_step

log = logging.getLogger("tinker_engine")

Op = Callable[[dict[str, Any]], dict[str, Any]]


class Engine:
    def __init__(self, placement: Placement, sampler_cache_size: int | None = None) -> None:
        if sampler_cache_size is None:
            sampler_cache_size = int(os.environ.get("TB_ENGINE_SAMPLER_CACHE", "4"))
        self.placement = placement
        self.registry = Registry(placement=placement, sampler_cache_size=max(1, sampler_cache_size))
        self.ops: dict[str, Op] = {
            "hello": self.hello,
            "load_base": self.load_base,
            "create_model": self.create_model,
            "forward_backward": lambda args: forward_backward(self.registry, args),
            "optim_step": lambda args: optim_step(self.registry, args),
            "save_sampler": lambda args: save_sampler(self.registry, args),
            "save_state": lambda args: save_state(self.registry, args),
            "load_state": lambda args: load_state(self.registry, args),
            "sample": lambda args: sample(self.registry, args),
            "unload_model": self.unload_model,
        }

    # --- ops that only touch the registry -------------------------------------------------------

    def hello(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"protocol": PROTOCOL_VERSION, "engine": "torch", "device": self.placement.device_name,
                "torch": torch.__version__}

    def load_base(self, args: dict[str, Any]) -> dict[str, Any]:
        base = self.registry.load_base(get_str(args, "name"), get_str(args, "path"))
        return base.info()

    def create_model(self, args: dict[str, Any]) -> dict[str, Any]:
        lora = LoraSpec.parse(get_obj(args, "lora"))
        model = self.registry.create_model(get_str(args, "model_id"), get_str(args, "base_model"), lora)
        return {"model_id": model.model_id, "lora_rank": model.lora.rank}

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
        return handler(args)

    def reply(self, body: bytes) -> dict[str, Any]:
        """The reply to one request frame; never raises for a bad request or a failing op."""
        return reply(self.call, body)


def reply(call: Callable[[str, dict[str, Any]], dict[str, Any]], body: bytes) -> dict[str, Any]:
    """The reply to one request frame, running it with ``call(op, args)``; never raises.

    Shared by every engine speaking this protocol (torch, verl): a ``UserError`` becomes a
    ``user`` error reply, any other exception a ``server`` one; the engine keeps serving.
    """
    request_id: Any = None
    op = "?"
    subject = ""
    start = time.perf_counter()
    try:
        request = json.loads(body.decode("utf-8"))
        if not isinstance(request, dict):
            raise ValueError("a request must be a JSON object")
        request_id = request.get("id")
        if not is_int(request_id):
            raise ValueError("request id must be an integer")
        op = request.get("op")
        if not isinstance(op, str):
            raise ValueError("request op must be a string")
        args = request.get("args", {})
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ValueError("request args must be an object")
        if args.get("model_id"):
            subject = f"model_id={args['model_id']}"
        elif args.get("base_model") or args.get("name"):
            subject = f"base={args.get('base_model') or args.get('name')}"
        result = call(op, args)
        _log(op, subject, start, "ok")
        return {"id": request_id, "ok": True, "result": result}
    except UserError as exc:
        _log(op, subject, start, f"user_error: {exc}")
        return {"id": request_id, "ok": False, "error": {"category": "user", "message": str(exc)}}
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reply; the engine keeps serving
        log.error("op=%s failed:\n%s", op, traceback.format_exc().rstrip())
        _log(op, subject, start, "server_error")
        if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        return {"id": request_id, "ok": False,
                "error": {"category": "server", "message": f"{type(exc).__name__}: {message}"}}


def _log(op: str, subject: str, start: float, outcome: str) -> None:
    ms = (time.perf_counter() - start) * 1000.0
    log.info("op=%s %s ms=%.1f %s", op, subject or "model_id=-", ms, outcome)
