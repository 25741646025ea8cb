"""Packed vs padded micro-batches, and chunked vs full output-layer logprobs (issue 35 items 1 and 2).

    .venv/bin/python bench/packing.py                         # CPU, models/tiny-qwen3 (a minute)
    python bench/packing.py --model 1.7b --device cuda        # GPU: bench/gpu/packing.sh runs this (also 8b)

1. The torch engine in this process (tinker_engine.engine.Engine, float32 on the CPU, bf16 on CUDA),
   LoRA rank 32 (4 on the tiny model) on every target, ``forward_backward`` with cross_entropy over
   16 datums whose lengths are uniform over 64-2048 tokens (divided by --scale: 4 on the tiny model),
   per layout (TB_ENGINE_LAYOUT: padded, packed) and output layer (TB_ENGINE_HEAD_CHUNK_TOKENS: the
   default chunks, or whole: the logits kept, nothing recomputed). Tokens/s counts real tokens only.
2. The output layer alone: target logprobs and their backward for --head-tokens tokens over Qwen3's
   151,936-entry vocabulary, the full logits (logprobs.target_logprobs) vs chunked
   (chunked_logprobs.head_target_logprobs; chunks of 256 tokens on the CPU, the engine's 1024 on CUDA).

Each measurement runs in its own process. Peak memory is what the measured work allocates beyond what
was allocated before it (``PeakMemory``): on CUDA ``max_memory_allocated``, on the CPU the resident
set polled every 0.5 ms (a peak shorter than that can be missed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys
import threading
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers" / "python"))
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import torch  # noqa: E402

VOCAB = 151936  # Qwen3's


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class PeakMemory:
    """The most memory allocated inside the block beyond what was allocated at its start: on CUDA the
    allocator's peak; on the CPU the resident set, read every 0.5 ms by a thread (torch's kernels
    release the GIL), freed memory handed back to the system (malloc_trim) before the start is read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self._start = self._high = _rss_bytes()
        self._stop = threading.Event()

        def poll() -> None:
            while not self._stop.is_set():
                self._high = max(self._high, _rss_bytes())
                time.sleep(0.0005)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self._high, _rss_bytes()) - self._start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lengths(n: int, lo: int, hi: int, scale: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [max(1, int(x) // scale) for x in torch.randint(lo, hi + 1, (n,), generator=gen)]


def engine_case(args: argparse.Namespace, layout: str, head: str, kernels: str = "none") -> dict[str, Any]:
    from tinker_engine.device import Placement
    from tinker_engine.engine import Engine
    from tinker_engine.settings import overridden
    from tinker_engine.tensors import tensor_to_json

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    eng = Engine(Placement(device=device, dtype=dtype), sampler_cache_size=1)
    with overridden(kernels=kernels):  # TB_ENGINE_KERNELS: applied as the base model loads
        eng.call("load_base", {"name": "b", "path": args.path})
    from tinker_engine import packing

    base = eng.registry.base("b")
    vocab = base.vocab_size
    attention = packing.varlen_implementation() if layout == "packed" and packing.flash_available(base) else base.hf.config._attn_implementation
    eng.call("create_model", {"model_id": "m", "base_model": "b",
                              "lora": {"rank": args.rank, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}})
    lens = lengths(args.datums, 64, 2048, args.scale, seed=0)
    gen = torch.Generator().manual_seed(1)
    data = []
    for n in lens:
        toks = torch.randint(0, vocab, (n + 1,), generator=gen)
        data.append({"tokens": toks[:-1].tolist(), "loss_fn_inputs": {"target_tokens": tensor_to_json(toks[1:])}})
    req = {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False, "data": data}
    changes: dict[str, Any] = {"layout": layout}
    if args.max_batch_tokens:
        changes["max_batch_tokens"] = args.max_batch_tokens
    if head == "whole":
        changes["head_chunk_tokens"] = 1 << 30
    with overridden(**changes):
        for _ in range(args.warmup):
            eng.call("forward_backward", req)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        with PeakMemory(device) as mem:
            for _ in range(args.reps):
                t = time.perf_counter()
                r = eng.call("forward_backward", req)
                _sync(device)
                times.append(time.perf_counter() - t)
                losses.append(r["metrics"]["loss:sum"])
        peak = mem.peak
    times.sort()
    median = times[len(times) // 2]
    return {"case": f"engine {layout}, head {head}" + (f", {kernels}" if kernels != "none" else ""), "real_tokens": sum(lens), "tokens_per_s": sum(lens) / median,
            "ms": 1000 * median, "peak_mib": peak / 2**20, "loss": losses[-1], "lengths": lens, "attention": attention}


def head_case(args: argparse.Namespace, how: str) -> dict[str, Any]:
    from tinker_engine import chunked_logprobs
    from tinker_engine.logprobs import target_logprobs

    from tinker_engine.settings import current, overridden

    chunk = args.head_chunk or current().head_chunk_tokens
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.head_hidden, VOCAB, bias=False).to(device, dtype)
    head.weight.requires_grad_(False)
    hidden = (torch.randn(args.head_tokens, args.head_hidden, generator=gen) * 0.5).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (args.head_tokens,), generator=gen).to(device)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    with PeakMemory(device) as mem:
        if how == "full":
            lp = target_logprobs(head(hidden), targets)
        else:
            with overridden(head_chunk_tokens=chunk):
                lp = chunked_logprobs.head_target_logprobs(hidden, head, targets)
        lp.sum().backward()
        _sync(device)
    ms = 1000 * (time.perf_counter() - t)
    peak = mem.peak
    return {"case": f"head {how}", "tokens": args.head_tokens, "hidden": args.head_hidden, "vocab": VOCAB,
            "chunk": chunk if how == "chunked" else None, "ms": ms, "peak_mib": peak / 2**20,
            "logprob_sum": float(lp.detach().float().sum())}


def run_one(args: argparse.Namespace) -> None:
    kind, *how = args.one.split(":")
    out = engine_case(args, *how) if kind == "engine" else head_case(args, *how)
    print("RESULT " + json.dumps(out))


def child(args: argparse.Namespace, one: str) -> dict[str, Any] | None:
    """One case in a process of its own (its peak memory alone); None when it failed (printed: an
    out-of-memory at this size is a result too), and the other cases still run."""
    argv = [sys.executable, __file__, "--one", one, "--path", args.path, "--device", args.device,
            "--scale", str(args.scale), "--rank", str(args.rank), "--datums", str(args.datums),
            "--reps", str(args.reps), "--warmup", str(args.warmup), "--head-tokens", str(args.head_tokens),
            "--head-hidden", str(args.head_hidden), "--head-chunk", str(args.head_chunk), "--max-batch-tokens", str(args.max_batch_tokens)]
    run = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        oom = [line for line in run.stderr.splitlines() if "OutOfMemoryError" in line]
        print(f"{one} failed (exit {run.returncode}): {oom[-1] if oom else run.stderr[-3000:]}", flush=True)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (models/tiny-qwen3), or a shape of bench/gpu/engine_vs_plain.py MODELS: 1.7b, 8b")
    p.add_argument("--path", default="", help="a model directory (default: per --model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--scale", type=int, default=0, help="lengths 64-2048 divided by this (default: 4 on tiny, else 1)")
    p.add_argument("--rank", type=int, default=0, help="LoRA rank (default: 4 on tiny, else 32)")
    p.add_argument("--datums", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-batch-tokens", type=int, default=0, help="TB_ENGINE_MAX_BATCH_TOKENS (0: the engine's default)")
    p.add_argument("--head-tokens", type=int, default=0, help="tokens of the output-layer case (default: 1024 on the CPU, 16384 on CUDA)")
    p.add_argument("--head-chunk", type=int, default=0, help="tokens per output-layer chunk (default: 256 on the CPU, the engine's on CUDA)")
    p.add_argument("--head-hidden", type=int, default=0, help="hidden size of the output-layer case (default: 64 on tiny, else the shape's)")
    p.add_argument("--kernels", default="none", help="liger: also the packed and padded cases with TB_ENGINE_KERNELS=liger (CUDA)")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    tiny = args.model == "tiny"
    args.scale = args.scale or (4 if tiny else 1)
    args.rank = args.rank or (4 if tiny else 32)
    cuda = args.device.startswith("cuda")
    args.head_tokens = args.head_tokens or (16384 if cuda else 2048)
    args.head_chunk = args.head_chunk or (0 if cuda else 256)
    if not args.head_hidden:
        from engine_vs_plain import MODELS

        args.head_hidden = 64 if tiny else MODELS[args.model]["hidden_size"]
    if args.one:
        run_one(args)
        return 0
    tmp = None
    if not args.path:
        if tiny:
            args.path = str(REPO / "models" / "tiny-qwen3")
        else:
            from engine_vs_plain import write_model

            tmp = tempfile.TemporaryDirectory(prefix="packing-bench-")
            args.path = str(Path(tmp.name) / args.model)
            write_model(args.model, Path(args.path), torch.device(args.device), torch.bfloat16)
    print(f"torch {torch.__version__}, device {args.device}, model {args.model} ({args.path}), LoRA rank {args.rank}, "
          f"{args.datums} datums, lengths uniform 64-2048 / {args.scale}")
    cases: tuple[str, ...] = ("engine:padded:whole", "engine:padded:chunked", "engine:packed:chunked", "engine:packed:whole", "head:full", "head:chunked")
    if args.kernels != "none":
        cases += (f"engine:padded:whole:{args.kernels}", f"engine:packed:whole:{args.kernels}")
    results = [child(args, one) for one in cases]
    eng = results[:4] + results[6:]
    first = next((r for r in eng if r), None)
    if first:
        print(f"lengths: {first['lengths']} ({first['real_tokens']} real tokens)")
    for one, r in zip(cases[:4] + cases[6:], eng):
        if r is None:
            print(f"{one:32s} failed (above)")
            continue
        print(f"{r['case']:32s} {r['tokens_per_s']:10.0f} tokens/s  {r['ms']:9.1f} ms/forward_backward  "
              f"peak {r['peak_mib']:8.1f} MiB  loss:sum {r['loss']:.4f}  attention {r['attention']}")
    for a, b in ((2, 1), (3, 0), (5, 0)):  # the same forward_backward packed and padded (fused or not): loss:sum agreement
        if a < len(eng) and eng[a] and eng[b]:
            print(f"loss:sum {eng[a]['case']} vs {eng[b]['case']}: relative difference "
                  f"{abs(eng[a]['loss'] - eng[b]['loss']) / max(abs(eng[b]['loss']), 1e-30):.2e}")
    for a, b, what in ((2, 0, "packed, head chunked / padded, head whole (the engine before issue 35)"),
                       (1, 0, "padded, head chunked / padded, head whole"),
                       (5, 0, f"packed, {args.kernels} / padded, no fused kernels (the engine before issue 35)"),
                       (5, 4, f"packed / padded, both {args.kernels}")):
        if a >= len(eng) or b >= len(eng):
            continue
        if eng[a] and eng[b]:
            print(f"{what}: {eng[a]['tokens_per_s'] / eng[b]['tokens_per_s']:.2f}x tokens/s, "
                  f"{eng[a]['peak_mib'] / max(eng[b]['peak_mib'], 1e-9):.2f}x peak memory")
    for r in results[4:6]:
        if r is None:
            continue
        print(f"{r['case']:16s} {r['tokens']} tokens x {r['vocab']} vocab (hidden {r['hidden']}, chunk {r['chunk']}): "
              f"{r['ms']:9.1f} ms  peak {r['peak_mib']:8.1f} MiB  sum {r['logprob_sum']:.3f}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
