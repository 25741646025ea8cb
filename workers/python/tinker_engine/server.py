"""The request loop: one request at a time, in order, each answered exactly once."""

from __future__ import annotations

import logging

from .channel import Channel
from .engine import Engine

log = logging.getLogger("tinker_engine")


def serve(channel: Channel, engine: Engine) -> int:
    """Serve until the channel closes (EOF on stdin); returns the exit code, 0."""
    while True:
        body = channel.read()
        if body is None:
            log.info("stdin closed; exiting")
            return 0
        try:
            channel.write(engine.reply(body))
        except BrokenPipeError:
            log.info("stdout closed; exiting")
            return 0
