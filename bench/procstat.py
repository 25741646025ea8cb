"""The Python benchmarks' reads of Linux /proc: the CPU a process and its children have used (bench/proc.ts
is the same for the Node benchmarks). Imported by the scripts beside it (run as ``python bench/<script>.py``)."""

from __future__ import annotations

import os
import time

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float:
    """utime + stime of a process so far, in ms."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS


def tree(pid: int, named: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """A process and its living descendants, less those in ``named`` (counted under their own name)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split() if int(c) not in named]
        except OSError:
            pass
    return out


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU ms of each named process with its descendants (a descendant named itself counts under its own name)."""
    out: dict[str, float] = {}
    named = set(pids.values())
    for name, pid in pids.items():
        total = 0.0
        for p in tree(pid, named):
            try:
                total += cpu_ms(p)
            except OSError:
                pass
        out[name] = total
    return out


def settle(pids: dict[str, int], limit_s: float | None = None) -> dict[str, float]:
    """Waits until the processes used no CPU tick over 50 ms (at most ``limit_s``, None: however long it
    takes); their last snapshot."""
    last = snapshot(pids)
    start = time.monotonic()
    while limit_s is None or time.monotonic() - start < limit_s:
        time.sleep(0.05)
        now = snapshot(pids)
        if sum(now.values()) == sum(last.values()):
            return now
        last = now
    return last
