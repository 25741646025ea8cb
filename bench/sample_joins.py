"""The torch engine's sampler when a burst's requests join a running generation, against the same
rows sent as one request, in one process (no broker): what a burst of one-sample requests costs the
engine itself, on the CPU or a GPU.

    .venv/bin/python bench/sample_joins.py [--model models/tiny-qwen3] [--rows 32] [--tokens 64]
        [--groups 10,8,1,13] [--every 3] [--device cpu] [--rounds 3]

Three ways, ``--rounds`` times each in alternation, every row exactly ``--tokens`` long (EOS off) from a
16-token prompt:

- ``one``: one ``sample_batch`` request of ``--rows`` samples (the plain alternative);
- ``together``: ``--rows`` one-sample requests in one ``sample_batch`` (a burst gathered whole);
- ``joins``: the same requests as ``sample_batch`` calls of ``--groups`` requests each, the next call
  added every ``--every`` decode steps while the generation runs (a burst that reaches the engine in
  pieces, as the agent's gatherer sends it; docs/benchmarks.md "What is left for 1.5×").

Prints per way the median wall time, the decode steps run (calls of ``Sampler.advance``), the time per
step and tokens/s. ``--device cuda`` on a GPU machine (bfloat16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "workers" / "python"))
from tinker_engine.device import Placement  # noqa: E402
from tinker_engine.engine import Engine  # noqa: E402


def request(n: int, tokens: int, seed: int, k: int | None = None) -> dict[str, Any]:
    """One sample request of 16 prompt tokens, EOS off, with every field the agent sends (the engine's
    protocol requires them on its channel); ``k``: the k-th of distinct prompts, as bench/sampling.ts
    ratio sends them (None: the same prompt for every request)."""
    prompt = list(range(5, 21)) if k is None else [5 + ((k * 31 + j * 7) % 1000) for j in range(16)]
    return {"adapter_dir": None, "prompt": prompt, "num_samples": n,
            "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": seed,
                                "stop_tokens": [], "stop_strings": [], "stop_at_eos": False},
            "prompt_logprobs": False, "topk_prompt_logprobs": 0, "target_prompt_logprobs": None,
            "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0}


def drive(engine: Engine, calls: list[list[dict[str, Any]]], every: int, device: torch.device) -> tuple[float, int, int]:
    """Adds the calls' requests ``every`` steps apart and runs the sampler until all are done: wall s, steps, tokens."""
    sampler = engine.sampler
    pending = list(calls)
    running: list[Any] = []
    steps = 0
    tokens = 0
    t = time.perf_counter()
    while pending or running:
        if pending and (not running or steps % max(1, every) == 0):
            gen = sampler.sample_batch_steps({"base_model": "b", "requests": pending.pop(0)})
            running.append(gen)
        still = []
        for gen in running:
            try:
                next(gen)
                still.append(gen)
            except StopIteration as done:
                tokens += sum(len(s["tokens"]) for r in done.value["results"] for s in r["result"]["sequences"])
        running = still
        if sampler.busy:
            sampler.advance()
            steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, steps, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--groups", default="10,8,1,13", help="requests per sample_batch call of the 'joins' way")
    ap.add_argument("--every", type=int, default=3, help="decode steps between two calls of the 'joins' way")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cudnn-attention", action="store_true",
                    help="on CUDA, leave cuDNN's attention in scaled_dot_product_attention (the engine leaves it out "
                         "unless TB_ENGINE_CUDNN_ATTENTION=1)")
    ap.add_argument("--vary", action="store_true",
                    help="the 'joins' way's calls come --every + round steps apart: shapes not seen in the warm-up or an earlier round")
    ap.add_argument("--profile", action="store_true", help="then cProfile one more run of the 'joins' way (top 20 by own time)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = [int(x) for x in args.groups.split(",")]
    if sum(groups) != args.rows:
        sys.exit(f"--groups add up to {sum(groups)}, not --rows {args.rows}")
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(args.cudnn_attention)
    engine = Engine(Placement(device=device, dtype=dtype), sampler_cache_size=1)
    engine.call("load_base", {"name": "b", "path": args.model})

    def ways(seed: int) -> dict[str, tuple[list[list[dict[str, Any]]], int]]:
        singles = [request(1, args.tokens, seed + i) for i in range(args.rows)]
        calls, i = [], 0
        for g in groups:
            calls.append(singles[i:i + g])
            i += g
        return {"one": ([[request(args.rows, args.tokens, seed)]], 1), "together": ([singles], 1), "joins": (calls, args.every)}

    for calls, every in ways(0).values():  # warm-up
        drive(engine, calls, every, device)
    got: dict[str, list[tuple[float, int, int]]] = {k: [] for k in ways(0)}
    for r in range(args.rounds):
        for name, (calls, every) in ways(1000 * (r + 1)).items():
            got[name].append(drive(engine, calls, every + (r + 1 if args.vary and name == "joins" else 0), device))
    print(f"torch {torch.__version__}, {args.model}, device {args.device}"
          f"{' (cuDNN attention on)' if args.cudnn_attention else ''}, {args.rows} rows x {args.tokens} tokens, "
          f"joins: calls of {args.groups} every {args.every}{' + round' if args.vary else ''} steps; median of {args.rounds} rounds")
    base = statistics.median(w for w, _, _ in got["one"])
    for name, runs in got.items():
        wall = statistics.median(w for w, _, _ in runs)
        steps = statistics.median(s for _, s, _ in runs)
        toks = runs[0][2]
        print(f"  {name:9s}: {wall * 1000:8.1f} ms, {steps:5.0f} steps, {wall * 1000 / steps:6.2f} ms/step, "
              f"{toks / wall:9.0f} tokens/s, one / this {base / wall:.2f}", flush=True)
    if args.profile:
        import cProfile
        import pstats
        calls, every = ways(99_000)["joins"]
        prof = cProfile.Profile()
        prof.runcall(drive, engine, calls, every, device)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
