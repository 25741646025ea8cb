"""``snapshot_state``: continuous snapshots of a model's training state, written off the hot path.

The agent asks for one after an optim_step (every k steps or t seconds). The engine copies the
model's LoRA weights and AdamW state on the model's device (``capture_state(on_device=True)``: one
multi-tensor kernel per dtype, the only part the next op waits for) and hands the copy to a writer
thread. The writer moves it to CPU memory on a CUDA stream of its own (so the copy overlaps the
next ops instead of delaying them; the snapshot's device copy is freed then) and puts it on disk in
save_state's format (``state.write_state``: a temporary directory, fsynced, renamed into place), so
a snapshot directory is either complete or absent. Then it removes the model's older snapshots,
keeping the newest ``keep``, and any temporary directory a crash left.

A model's snapshot directories are ``<root>/<seq_id, 12 digits>``, so their names sort by seq_id.
At most one capture per model waits for the writer: a newer one replaces it (it covers more).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

import torch

from .models import Registry
from .params import get_bool, get_int, get_str
from .state import CapturedState, capture_state, write_state

log = logging.getLogger("tinker_engine")

SEQ_DIGITS = 12


def snapshot_dir(root: str, seq_id: int) -> str:
    return os.path.join(root, f"{seq_id:0{SEQ_DIGITS}d}")


def complete_snapshots(root: str) -> list[str]:
    """The complete snapshot directories under ``root``, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [os.path.join(root, n) for n in sorted(names) if n.isdigit() and len(n) == SEQ_DIGITS]


class SnapshotWriter:
    """One writer thread for every model's snapshots."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # model root -> (path, captured, keep, ready), the newest capture not yet taken by the writer;
        # `ready`: a CUDA event recorded after the device copy (None on the CPU).
        self._pending: dict[str, tuple[str, CapturedState, int, Any]] = {}
        self._stream: Any = None
        self._writing: str | None = None
        self._written: dict[str, str] = {}
        self._errors: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()

    def submit(self, root: str, path: str, captured: CapturedState, keep: int, ready: Any = None) -> None:
        with self._cond:
            self._pending[root] = (path, captured, keep, ready)
            self._cond.notify_all()

    def wait(self, path: str) -> None:
        """Until ``path`` is written (or replaced by a newer capture, or failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._writing != path and all(p[0] != path for p in self._pending.values()))

    def status(self, root: str) -> dict[str, Any]:
        with self._cond:
            return {"last_written": self._written.get(root), "last_error": self._errors.get(root)}

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                root = next(iter(self._pending))
                path, captured, keep, ready = self._pending.pop(root)
                self._writing = path
            try:
                captured = self._host(captured, ready)
                if not os.path.lexists(path):
                    write_state(captured, path)
                self._rotate(root, path, keep)
                with self._cond:
                    self._written[root] = path
                    self._errors.pop(root, None)
            except Exception as exc:  # a full disk, a removed directory: the next snapshot tries again
                log.error("snapshot %s not written: %s", path, exc)
                with self._cond:
                    self._errors[root] = f"{path}: {exc}"
            finally:
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()

    def _host(self, captured: CapturedState, ready: Any) -> CapturedState:
        """The capture in CPU memory: on a GPU, copied on this thread's own stream once the device
        copy is done (``ready``), so the engine's stream runs on meanwhile."""
        if ready is None:
            return captured.host()
        device = next(iter(captured.adapter_tensors.values())).device
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            out = captured.host()
        self._stream.synchronize()
        return out

    @staticmethod
    def _rotate(root: str, newest: str, keep: int) -> None:
        done = complete_snapshots(root)
        for old in done[: max(0, len(done) - keep)]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)
        for name in os.listdir(root):
            if ".tmp-" in name:  # left by a crash: the writer is the only one writing here
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def snapshot_state(registry: Registry, writer: SnapshotWriter, args: dict[str, Any]) -> dict[str, Any]:
    """Captures the model's state (weights and AdamW state) covering ``seq_id`` and queues its write
    under ``root``; with ``wait``, returns once it is on disk."""
    model = registry.model(get_str(args, "model_id"))
    root = os.path.normpath(os.path.abspath(get_str(args, "root")))
    seq_id = get_int(args, "seq_id")
    keep = max(1, get_int(args, "keep"))
    path = snapshot_dir(root, seq_id)
    captured = capture_state(model, with_optimizer=True, on_device=True)
    nbytes = sum(t.numel() * t.element_size() for t in captured.adapter_tensors.values())
    nbytes += sum(t.numel() * t.element_size() for t in (captured.optimizer or ({}, {}))[0].values())
    ready = None
    if model.flat.weight.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    writer.submit(root, path, captured, keep, ready)
    if get_bool(args, "wait", default=False):
        writer.wait(path)
    return {"dir": path, "captured_bytes": nbytes, **writer.status(root)}
