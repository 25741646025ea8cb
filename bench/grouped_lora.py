"""A co-batched pass with the grouped LoRA product against one adapter at a time, and against the
members' forward_backward ops one after another (issue 34; cobatch.py, grouped_lora.py).

    .venv/bin/python bench/grouped_lora.py                    # CPU, models/tiny-qwen3 (a minute)
    python bench/gpu/profile_train.py --members 1,2,4,8      # GPU: the same measurement at Qwen3's shape

In this process (the torch engine's own functions, no channel): N models of one base, LoRA on every
target (rank --rank), each with --datums datums of --seq tokens and cross_entropy. Per N, alternating
for --rounds rounds (median ms): the N forward_backward ops one after another (``solo``), one
forward_backward_group of the N with each adapter over its tokens on its own (``one by one``,
cobatch.GROUPED off) and with the grouped product (``grouped``). ``ops`` counts the leaf aten ops of
one pass (an op that calls no other aten op, a multi-tensor ``_foreach_`` op as one: on a GPU, about
one kernel launch each; on CUDA the cudaLaunchKernel calls themselves) from torch.profiler, once per
variant.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers" / "python"))

import torch  # noqa: E402

from tinker_engine import cobatch  # noqa: E402
from tinker_engine.device import Placement  # noqa: E402
from tinker_engine.engine import Engine  # noqa: E402
from tinker_engine.tensors import tensor_to_json  # noqa: E402


def requests(eng: Engine, base: str, n: int, datums: int, seq: int, rank: int, vocab: int) -> list[dict[str, Any]]:
    """Forward_backward requests of ``n`` fresh models ``g0``..: ``datums`` random datums of ``seq`` tokens each."""
    gen = torch.Generator().manual_seed(n)
    out = []
    for k in range(n):
        model_id = f"g{k}"
        if model_id not in eng.registry.models:
            eng.call("create_model", {"model_id": model_id, "base_model": base, "lora": {
                "rank": rank, "seed": k, "train_attn": True, "train_mlp": True, "train_unembed": True}})
        data = [{"tokens": torch.randint(0, vocab, (seq,), generator=gen).tolist(),
                 "loss_fn_inputs": {"target_tokens": tensor_to_json(torch.randint(0, vocab, (seq,), generator=gen))}}
                for _ in range(datums)]
        out.append({"model_id": model_id, "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False, "data": data})
    return out


def variants(eng: Engine, reqs: list[dict[str, Any]]) -> dict[str, Callable[[], None]]:
    def solo() -> None:
        for r in reqs:
            eng.call("forward_backward", r)

    def group(grouped: bool) -> Callable[[], None]:
        def run() -> None:
            cobatch.GROUPED = grouped
            try:
                results = eng.call("forward_backward_group", {"members": reqs})["results"]
            finally:
                cobatch.GROUPED = True
            assert all("error" not in r for r in results), results
        return run

    return {"solo": solo, "one by one": group(False), "grouped": group(True)}


def launches(fn: Callable[[], None], cuda: bool) -> int:
    """Kernel launches of one call of ``fn``: on CUDA the cudaLaunchKernel calls torch.profiler sees; on
    the CPU its leaf aten ops (ops that call no other aten op), each about one launch on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key)
    return sum(1 for e in prof.events() if _leaf(e))


def _leaf(e: Any) -> bool:
    """An aten op that calls no other aten op; a multi-tensor ``_foreach_`` op counts as one (the CPU
    runs it per tensor, CUDA in a launch or a few)."""
    if not e.name.startswith("aten::"):
        return False
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::_foreach_"):
            return False
        parent = parent.cpu_parent
    return e.name.startswith("aten::_foreach_") or not any(c.name.startswith("aten::") for c in e.cpu_children)


def measure(eng: Engine, base: str, members: list[int], datums: int, seq: int, rank: int, rounds: int) -> None:
    """Prints the table of the module docstring for each group size in ``members``."""
    cuda = eng.registry.base(base).device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab = eng.registry.base(base).vocab_size
    what = "cudaLaunchKernel" if cuda else "leaf aten ops"
    print(f"=== forward_backward of N models, {datums} x {seq} tokens each, LoRA rank {rank}: "
          f"median ms of {rounds} alternating rounds; {what} per pass (all N for solo) ===")
    print(f"  {'N':>3s} {'solo':>9s} {'one by one':>11s} {'grouped':>9s} {'ops solo':>9s} {'ops 1by1':>9s} "
          f"{'ops grp':>8s}  grouped vs solo, vs one by one")
    for n in members:
        runs = variants(eng, requests(eng, base, n, datums, seq, rank, vocab))
        for fn in runs.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(rounds):
            for label, fn in runs.items():
                sync()
                t = time.perf_counter()
                fn()
                sync()
                times[label].append(1000 * (time.perf_counter() - t))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        ops = {k: launches(fn, cuda) for k, fn in runs.items()}
        for k in range(n):  # the gradients accumulated here are not wanted
            eng.registry.model(f"g{k}").flat.zero_grad()
        print(f"  {n:3d} {med['solo']:9.1f} {med['one by one']:11.1f} {med['grouped']:9.1f} {ops['solo']:9d} "
              f"{ops['one by one']:9d} {ops['grouped']:8d}  {med['solo'] / med['grouped']:.2f}x, "
              f"{med['one by one'] / med['grouped']:.2f}x", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-qwen3"))
    ap.add_argument("--members", default="1,2,4,8", help="comma-separated group sizes (default 1,2,4,8)")
    ap.add_argument("--datums", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    eng = Engine(Placement(device=torch.device("cpu"), dtype=torch.float32))
    eng.call("load_base", {"name": "tiny", "path": args.model})
    measure(eng, "tiny", [int(n) for n in args.members.split(",")], args.datums, args.seq, args.rank, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
