"""Framing: a 4-byte unsigned big-endian length, then that many bytes of UTF-8 JSON."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame for ``message``. Non-finite floats (not valid JSON) are sent as null."""
    try:
        body = json.dumps(message, separators=(",", ":"), allow_nan=False)
    except ValueError:
        body = json.dumps(_finite(message), separators=(",", ":"), allow_nan=False)
    data = body.encode("utf-8")
    return _HEADER.pack(len(data)) + data


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Channel:
    """Reads request frames from ``reader`` and writes reply frames to ``writer``."""

    def __init__(self, reader: BinaryIO, writer: BinaryIO) -> None:
        self._reader = reader
        self._writer = writer

    def _read_exact(self, n: int) -> bytes | None:
        chunks: list[bytes] = []
        remaining = n
        while remaining > 0:
            chunk = self._reader.read(remaining)
            if not chunk:
                return None
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def read(self) -> bytes | None:
        """The next frame's body, or None when the channel is closed (EOF, even mid-frame)."""
        header = self._read_exact(_HEADER.size)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if length == 0:
            return b""
        return self._read_exact(length)

    def write(self, message: dict[str, Any]) -> None:
        self._writer.write(encode_frame(message))
        self._writer.flush()


def claim_stdio() -> tuple[BinaryIO, BinaryIO]:
    """The engine's protocol streams (stdin, and a private duplicate of fd 1), with fd 1 and
    ``sys.stdout`` pointed at stderr so that a stray ``print`` or a library writing to stdout can
    never corrupt the framing; logging goes to stderr at ``TB_ENGINE_LOG_LEVEL`` (default INFO).
    Every engine entry point (torch, verl) starts with it."""
    protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    logging.basicConfig(stream=sys.stderr, level=os.environ.get("TB_ENGINE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return sys.stdin.buffer, protocol_out
