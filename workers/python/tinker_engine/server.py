"""The request loop: every request answered exactly once, by id.

A reader thread takes request frames off the channel as they arrive. The loop runs ops that
finish at once (training, checkpoints, registry ops) as soon as they are read. Sample requests
join their base model's generating batch (sample.py), which the loop advances one decode step at
a time, checking for new requests between steps: a training op waits at most one decode step
for a sample batch in progress, and new sample requests join the batch at the next step. Replies
can therefore come back in another order than the requests; each carries its request's id.
"""

from __future__ import annotations

import logging
import queue
import threading

from .channel import Channel
from .engine import Engine, Task

log = logging.getLogger("tinker_engine")

_EOF = object()


def _read_all(channel: Channel, inbox: queue.Queue[object]) -> None:
    while True:
        body = channel.read()
        inbox.put(_EOF if body is None else body)
        if body is None:
            return


def serve(channel: Channel, engine: Engine) -> int:
    """Serve until the channel closes (EOF on stdin); returns the exit code, 0."""
    inbox: queue.Queue[object] = queue.Queue()
    threading.Thread(target=_read_all, args=(channel, inbox), name="engine-reader", daemon=True).start()
    running: list[Task] = []
    try:
        while True:
            # Block for a request only when nothing is generating.
            try:
                item = inbox.get(block=not running and not engine.busy)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _EOF:
                    log.info("stdin closed; exiting")
                    return 0
                assert isinstance(item, (bytes, bytearray))
                task = engine.start(item)
                reply = task.step()
                if reply is None:
                    running.append(task)
                else:
                    channel.write(reply)
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    item = None
            engine.advance()
            for task in list(running):
                reply = task.step()
                if reply is not None:
                    running.remove(task)
                    channel.write(reply)
    except BrokenPipeError:
        log.info("stdout closed; exiting")
        return 0
