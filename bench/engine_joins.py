"""bench/sample_joins.py's burst, sent to the engine as the agent sends it: ``python -m tinker_engine`` as
a child process on its pipes (protocol 2), not in this process. One ``sample_batch`` of one
one-sample request, then, ``--gap-ms`` later, one of ``--rows - 1`` one-sample requests that join
it; against one ``sample_batch`` of one ``--rows``-sample request. Prints each frame's reply time and
the engine's own ms (its reply's), median of ``--rounds``.

    .venv/bin/python bench/engine_joins.py [--model models/tiny-qwen3] [--device cpu] [--rows 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "workers" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from sample_joins import request  # noqa: E402
from tinker_engine.channel import Channel, decode_frame, encode_frame  # noqa: E402


# Each full collection of the child, its time and what it collected, on stderr.
GC_LOG = """_t = [0.0]
def _cb(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        print(f"gc: generation 2, {(time.perf_counter() - _t[0]) * 1000:.0f} ms, collected {info['collected']}", file=sys.stderr, flush=True)
gc.callbacks.append(_cb)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gap-ms", type=float, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gc", choices=("on", "off", "log"), default="on",
                    help="the child's garbage collector: as is, disabled, or each collection of generation 2 logged with its time")
    ap.add_argument("--cudnn-attention", action="store_true", help="the child with TB_ENGINE_CUDNN_ATTENTION=1")
    ap.add_argument("--profile", default="", help="run the child under cProfile, its stats written to this file")
    args = ap.parse_args()
    env = {**os.environ, "TB_ENGINE_DEVICE": args.device, "PYTHONPATH": str(ROOT / "workers" / "python"),
           "TB_ENGINE_CUDNN_ATTENTION": "1" if args.cudnn_attention else "0"}
    boot = {"on": "", "off": "gc.disable()\n", "log": GC_LOG}[args.gc]
    run = "runpy.run_module('tinker_engine', run_name='__main__')"
    if args.profile:
        run = f"import cProfile; cProfile.run({run!r}, {args.profile!r})"
    cmd = [sys.executable, "-c", f"import gc, runpy, sys, time\n{boot}{run}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdin and proc.stdout
    chan = Channel(proc.stdout, proc.stdin)  # type: ignore[arg-type]
    replies: dict[int, tuple[float, dict[str, Any]]] = {}
    done = threading.Condition()

    def reader() -> None:
        while True:
            body = chan.read()
            if body is None:
                return
            msg = decode_frame(body)
            with done:
                replies[msg["id"]] = (time.perf_counter(), msg)
                done.notify_all()

    threading.Thread(target=reader, daemon=True).start()
    next_id = [0]

    def send(op: str, a: dict[str, Any]) -> tuple[int, float]:
        next_id[0] += 1
        proc.stdin.write(encode_frame({"id": next_id[0], "op": op, "args": a}))
        proc.stdin.flush()
        return next_id[0], time.perf_counter()

    def wait(ids: list[int]) -> None:
        with done:
            done.wait_for(lambda: all(i in replies for i in ids), timeout=600)
        for i in ids:
            if i not in replies or not replies[i][1].get("ok"):
                sys.exit(f"request {i}: {replies[i][1] if i in replies else 'no reply in 600 s'}")

    i, _ = send("load_base", {"name": "b", "path": args.model})
    wait([i])
    print(f"engine child on {args.device}{' (TB_ENGINE_CUDNN_ATTENTION=1)' if args.cudnn_attention else ''}: load_base {replies[i][1].get('ok', replies[i][1])}", flush=True)

    def one_way(seed: int) -> float:
        i, t = send("sample_batch", {"base_model": "b", "requests": [request(args.rows, args.tokens, seed, 0)]})
        wait([i])
        return replies[i][0] - t

    def joins(seed: int) -> tuple[float, float, float]:
        a, t = send("sample_batch", {"base_model": "b", "requests": [request(1, args.tokens, seed, 0)]})
        time.sleep(args.gap_ms / 1000)
        b, _ = send("sample_batch", {"base_model": "b", "requests": [request(1, args.tokens, seed + k, k) for k in range(1, args.rows)]})
        wait([a, b])
        return max(replies[a][0], replies[b][0]) - t, replies[a][0] - t, replies[b][0] - t

    one_way(1)
    joins(100)
    ones, burst = [], []
    for r in range(args.rounds):
        ones.append(one_way(1000 * (r + 1)))
        burst.append(joins(2000 * (r + 1)))
    o = statistics.median(ones)
    b = statistics.median(w for w, _, _ in burst)
    print(f"{args.rows} rows x {args.tokens} tokens: one request {o * 1000:.1f} ms; 1 then {args.rows - 1} joining "
          f"{args.gap_ms:.0f} ms later {b * 1000:.1f} ms (first reply / second, ms: "
          f"{', '.join(f'{x * 1000:.0f}/{y * 1000:.0f}' for _, x, y in burst)}); one / burst {o / b:.2f}", flush=True)
    proc.stdin.close()
    proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
