"""Framing, protocol 2 (docs/engine-protocol.md): each frame is a 4-byte unsigned big-endian length
L, then a 4-byte unsigned big-endian length J, J bytes of UTF-8 JSON (space-padded so that 4 + J is
a multiple of 8), and L - 4 - J bytes of tensor data. A tensor inside the JSON is ``{"dtype", "shape", "bin": [offset, nbytes]}``: raw little-endian
bytes at ``offset`` (a multiple of 8) of the data part. Requests' tensors are decoded into CPU
``torch.Tensor`` values (int32 widened to int64); a ``torch.Tensor`` anywhere in a reply is sent
the same way, never as a JSON number list.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from typing import Any, BinaryIO

import torch

from .settings import current as settings

_HEADER = struct.Struct(">I")
_HEADERS = struct.Struct(">II")
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64}
_ITEM = {"float32": 4, "int32": 4, "int64": 8}

if sys.byteorder != "little":  # pragma: no cover - every x86 and ARM host is little-endian
    raise RuntimeError("the engine channel carries little-endian tensors; this host is big-endian")


class FrameError(ValueError):
    """A frame that cannot be decoded."""


def _wire_tensor(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    t = t.detach()
    if t.is_floating_point():
        return "float32", t.to(device="cpu", dtype=torch.float32).contiguous()
    return "int64", t.to(device="cpu", dtype=torch.int64).contiguous()


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame for ``message``; its tensors travel as binary. Non-finite JSON floats are sent as null."""
    chunks: list[bytes] = []
    size = [0]  # bytes of tensor data so far

    def bin_ref(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{type(value).__name__} cannot travel on the engine channel")
        dtype, t = _wire_tensor(value)
        data = t.numpy().tobytes()
        offset = size[0]
        chunks.append(data + b"\0" * (-len(data) % 8))
        size[0] += len(chunks[-1])
        return {"dtype": dtype, "shape": list(t.shape), "bin": [offset, len(data)]}

    try:
        text = json.dumps(message, separators=(",", ":"), allow_nan=False, default=bin_ref)
    except ValueError:
        chunks.clear()
        size[0] = 0
        text = json.dumps(_finite(message), separators=(",", ":"), allow_nan=False, default=bin_ref)
    body = text.encode("utf-8")
    # Spaces after the JSON (still valid JSON) put the tensor bytes 8-aligned from the body's start.
    body += b" " * (-(4 + len(body)) % 8)
    return _HEADERS.pack(4 + len(body) + size[0], len(body)) + body + b"".join(chunks)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def decode_frame(body: bytes | bytearray) -> Any:
    """The message of one frame body (after its length word), its tensors as CPU ``torch.Tensor`` values."""
    if len(body) < 4:
        raise FrameError(f"a frame of {len(body)} bytes has no JSON length")
    (j,) = _HEADER.unpack_from(body, 0)
    if 4 + j > len(body):
        raise FrameError(f"the JSON part ({j} bytes) runs past the frame ({len(body)} bytes)")
    message = json.loads(bytes(body[4:4 + j]).decode("utf-8"))
    # Tensors are views of the frame's bytes; torch wants them writable (the channel reads into a bytearray).
    blob = memoryview(body if isinstance(body, bytearray) else bytearray(body))[4 + j:]
    return _lower(message, blob)


def _lower(value: Any, blob: memoryview) -> Any:
    if isinstance(value, list):
        return [_lower(v, blob) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"dtype", "shape", "bin"} and isinstance(value["dtype"], str):
        return _read_tensor(value, blob)
    return {k: _lower(v, blob) for k, v in value.items()}


def _read_tensor(ref: dict[str, Any], blob: memoryview) -> torch.Tensor:
    dtype, shape, where = ref["dtype"], ref["shape"], ref["bin"]
    if dtype not in _DTYPES:
        raise FrameError(f"unknown tensor dtype {dtype!r}; known: {sorted(_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FrameError(f"tensor shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(where, list) or len(where) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in where)):
        raise FrameError(f"tensor bin must be [offset, nbytes], got {where!r}")
    offset, nbytes = where
    count = math.prod(shape)
    if count * _ITEM[dtype] != nbytes:
        raise FrameError(f"tensor of shape {shape} {dtype} needs {count * _ITEM[dtype]} bytes, has {nbytes}")
    if offset + nbytes > len(blob):
        raise FrameError(f"tensor bytes [{offset}, +{nbytes}) lie outside the frame's {len(blob)} bytes")
    if count == 0:
        t = torch.empty(0, dtype=_DTYPES[dtype])
    else:
        t = torch.frombuffer(blob, dtype=_DTYPES[dtype], count=count, offset=offset)
    t = t.reshape(shape)
    return t.to(torch.int64) if dtype == "int32" else t


class Channel:
    """Reads request frames from ``reader`` and writes reply frames to ``writer``."""

    def __init__(self, reader: BinaryIO, writer: BinaryIO) -> None:
        self._reader = reader
        self._writer = writer

    def _read_exact(self, n: int) -> bytearray | None:
        # A bytearray: tensors decoded from the frame are views of it (torch.frombuffer needs it writable).
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            chunk = self._reader.read(n - got)
            if not chunk:
                return None
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        return buf

    def read(self) -> bytearray | None:
        """The next frame's body (after its length word), or None when the channel is closed (EOF, even mid-frame)."""
        header = self._read_exact(_HEADER.size)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if length == 0:
            return bytearray()
        return self._read_exact(length)

    def write(self, message: dict[str, Any]) -> None:
        self._writer.write(encode_frame(message))
        self._writer.flush()


def claim_stdio() -> tuple[BinaryIO, BinaryIO]:
    """The engine's protocol streams (stdin, and a private duplicate of fd 1), with fd 1 and
    ``sys.stdout`` pointed at stderr so that a stray ``print`` or a library writing to stdout can
    never corrupt the framing; logging goes to stderr at the settings' level (``TB_ENGINE_LOG_LEVEL``).
    Every engine entry point (torch, verl) starts with it, so the engine's settings are read, and a
    bad one refused, as it starts."""
    level = settings().log_level
    protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    logging.basicConfig(stream=sys.stderr, level=level,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return sys.stdin.buffer, protocol_out
