"""The torch engine's decode step against the generated length: the sampler's growing key/value cache
(tinker_engine/kv_cache.py) against transformers' DynamicCache (one torch.cat of the whole cache per
layer and step), in one process, alternating.

    .venv/bin/python bench/decode_length.py [--shape small] [--rows 64] [--threads 2] [--lengths 32,64,128,256] [--rounds 2]

For each length it runs one ``sample_batch`` of one request of ``--rows`` samples (EOS off, so every row
generates exactly that many tokens) from a 16-token prompt, with the growing cache and with the plain
one, ``--rounds`` times each in alternation, and prints the median ms per decode step of each, their
ratio and whether the two gave the same tokens. ``--shape``: bench/gpu/engine_vs_plain.py's shapes
(``tiny``: hidden 64, 2 layers; ``small``: ~26M parameters, hidden 512, 8 layers), random weights,
float32, written once under /tmp; ``--device cuda`` on a GPU machine.
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
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
sys.path.insert(0, str(ROOT / "workers" / "python"))
from engine_vs_plain import write_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tinker_engine import kv_cache  # noqa: E402
from tinker_engine.device import Placement  # noqa: E402
from tinker_engine.engine import Engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="32,64,128,256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = Path(f"/tmp/decode-length-{args.shape}")
    if not (model / "config.json").exists():
        write_model(args.shape, model, device, dtype)
    engine = Engine(Placement(device=device, dtype=dtype), sampler_cache_size=1)
    engine.call("load_base", {"name": "b", "path": str(model)})
    growing = kv_cache.new_cache

    def run(n: int, plain: bool) -> tuple[float, Any]:
        kv_cache.new_cache = (lambda config: DynamicCache(config=config)) if plain else growing  # type: ignore[assignment]
        req = {"adapter_dir": None, "prompt": list(range(5, 21)), "num_samples": args.rows,
               "sampling_params": {"max_tokens": n, "temperature": 1.0, "seed": 1, "stop_at_eos": False},
               "prompt_logprobs": False, "topk_prompt_logprobs": 0}
        t = time.perf_counter()
        out = engine.call("sample_batch", {"base_model": "b", "requests": [req]})
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1000 / n, [s["tokens"] for s in out["results"][0]["result"]["sequences"]]

    run(8, False)  # warm-up
    print(f"torch {torch.__version__}, shape {args.shape}, {args.rows} rows, {args.threads} threads, device {args.device}; "
          f"ms per decode step (median of {args.rounds}), growing cache against DynamicCache")
    for n in (int(x) for x in args.lengths.split(",")):
        grow_ms, plain_ms, equal = [], [], True
        for _ in range(args.rounds):
            g, gt = run(n, False)
            p, pt = run(n, True)
            grow_ms.append(g)
            plain_ms.append(p)
            equal &= gt == pt
        g, p = statistics.median(grow_ms), statistics.median(plain_ms)
        print(f"  {n:5d} tokens: growing {g:7.2f} ms/step, DynamicCache {p:7.2f} ms/step, "
              f"DynamicCache / growing {p / g:.2f}x, same tokens: {equal}", flush=True)
    kv_cache.new_cache = growing  # type: ignore[assignment]
    return 0


if __name__ == "__main__":
    sys.exit(main())
