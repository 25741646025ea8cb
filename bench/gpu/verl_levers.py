"""The verl engine's levers on the GPU (issue 35 item 3): padding removed or kept, checkpointing, micro-batch
tokens, as tinker_engine_verl/levers.py chooses them, against the padded engine of before.

Run by bench/gpu/verl_levers.sh on the GPU machine. For each run (``--runs``, each a name and its
environment, default ``padded`` = TB_VERL_REMOVE_PADDING=0 TB_VERL_GRAD_CKPT=1, the engine before; and
``auto``, every lever left to the engine) it starts the verl engine under torchrun on one GPU, loads a
random-weight Qwen3 of the shape (bench/gpu/engine_vs_plain.py's ``MODELS``), creates a LoRA of rank 32 on
every linear layer and lm_head, and runs ``--steps`` cross_entropy forward_backward + optim_step after one
warm-up, on ``--datums`` datums of lengths uniform over ``--min-len``..``--max-len`` (mixed) or all
``--max-len`` (``--equal``). It prints the levers line the engine logged, ms per step, real tokens/s
(padding not counted), the peak of allocated GPU memory, and each run's losses against the first run's
(the same data and seeded init: they agree up to bf16 summation order).

Here, without a GPU: ``.venv/bin/python bench/gpu/verl_levers.py --cpu`` (tiny model, 2 steps) checks the
driver with verl on one CPU rank (var/verlsite on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_plain import MODELS, write_model  # noqa: E402
from verl_check import PY_DIR, EngineClient, ce_datum, make_data  # noqa: E402

RUNS = {"padded": {"TB_VERL_REMOVE_PADDING": "0", "TB_VERL_GRAD_CKPT": "1"}, "auto": {}}


def parse_runs(text: str) -> list[tuple[str, dict[str, str]]]:
    """``name[:VAR=value,...]`` separated by ``;`` (a known name alone: its settings above)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, rest = item.partition(":")
        env = dict(RUNS.get(name, {}))
        for kv in filter(None, rest.split(",")):
            k, _, v = kv.partition("=")
            env[k] = v
        out.append((name, env))
    return out


def run(name: str, extra: dict[str, str], args: argparse.Namespace, model: Path, data: list[dict[str, Any]],
        real_tokens: int, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PY_DIR), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TB_ENGINE_LOG_LEVEL": "INFO",
           **extra}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "tinker_engine_verl"]
    eng = EngineClient(name, argv, env, out / f"verl_{name}.log")
    result: dict[str, Any] = {"name": name, "env": extra}
    try:
        t = time.perf_counter()
        eng.call("hello")
        eng.call("load_base", {"name": "base", "path": str(model)})
        eng.call("create_model", {"model_id": "m", "base_model": "base",
                                  "lora": {"rank": args.rank, "seed": 7, "train_attn": True, "train_mlp": True, "train_unembed": True}})
        result["start_s"] = time.perf_counter() - t
        line = next((ln for ln in Path(eng.log_path).read_text(errors="replace").splitlines() if "verl levers" in ln), "(no levers line)")
        result["levers"] = re.sub(r"^.*verl levers", "verl levers", line)
        adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
        losses, ms, fb_ms = [], [], []
        for step in range(args.steps + 1):
            if step == 1:
                eng.call("memory", {"reset_peak": True})
            t = time.perf_counter()  # the engine replies once the op ran on its GPU (its result read back)
            r = eng.call("forward_backward", {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {},
                                              "forward_only": False, "data": data})
            fb = (time.perf_counter() - t) * 1000
            eng.call("optim_step", {"model_id": "m", "adam": adam})
            dt = (time.perf_counter() - t) * 1000
            losses.append(float(r["metrics"]["loss:sum"]))
            if step > 0:  # step 0 warms up
                ms.append(dt)
                fb_ms.append(fb)
            print(f"  [{name}] step {step}: loss:sum {losses[-1]:.4f}, {dt:.0f} ms (forward_backward {fb:.0f}){' (warm-up)' if step == 0 else ''}", flush=True)
        result["peak_gib"] = eng.call("memory")["max_allocated_bytes"] / 2**30
        ms.sort()
        fb_ms.sort()
        result["ms"] = ms[len(ms) // 2]
        result["fb_ms"] = fb_ms[len(fb_ms) // 2]
        result["tokens_s"] = real_tokens / (result["ms"] / 1000)
        result["losses"] = losses
    except RuntimeError as exc:
        result["error"] = str(exc).splitlines()[0][:400]
        print(f"  [{name}] failed: {result['error']}\n{eng.tail(15)}", flush=True)
    finally:
        eng.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.7b", choices=sorted(MODELS))
    ap.add_argument("--runs", default="padded;auto", help="name[:VAR=value,...] separated by ';' (padded, auto: preset)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--datums", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--equal", action="store_true", help="every datum --max-len tokens")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--work", default="/tmp/verl_levers")
    ap.add_argument("--keep", default=None, help="a model directory of the shape, written once and reused")
    ap.add_argument("--cpu", action="store_true", help="tiny model on one CPU rank, 2 steps (a check of this driver)")
    args = ap.parse_args()
    if args.cpu:
        args.model, args.steps, args.datums, args.min_len, args.max_len, args.rank = "tiny", 2, 4, 8, 40, 4
    out = Path(os.environ.get("OUT", args.work))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.keep) if args.keep else work / f"qwen3-{args.model}"
    if not (model / "config.json").exists():
        t = time.perf_counter()
        write_model(args.model, model, torch.device("cpu" if args.cpu else "cuda"), torch.float32 if args.cpu else torch.bfloat16)
        print(f"[model] Qwen3 {args.model} shape written in {time.perf_counter() - t:.1f}s", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # this process's cached blocks, not the engines' memory
    vocab = MODELS[args.model]["vocab_size"]
    lo = args.max_len if args.equal else args.min_len
    seqs = make_data(args.datums, lo, args.max_len, vocab, seed=1)
    data = [ce_datum(s) for s in seqs]
    real = sum(len(s) - 1 for s in seqs)
    padded = len(seqs) * max(len(s) - 1 for s in seqs)
    print(f"[data] {len(seqs)} datums, lengths {lo}..{args.max_len}: {real} real tokens, {padded} padded "
          f"({real / padded:.0%} real); LoRA rank {args.rank} on every linear layer and lm_head; cross_entropy", flush=True)
    if torch.cuda.is_available():
        print(f"[gpu] {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB; "
              f"torch {torch.__version__}", flush=True)
    results = [run(name, env, args, model, data, real, out) for name, env in parse_runs(args.runs)]
    ok = [r for r in results if "error" not in r]
    print("\n| run | levers (the engine's log) | ms / step (forward_backward) | real tokens/s | vs first | peak GiB | max loss rel diff vs first |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | {r.get('levers', '')} | failed: {r['error']} | | | | |")
            continue
        first = ok[0]
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], first["losses"]))
        print(f"| {r['name']} | {r['levers']} | {r['ms']:.0f} ({r['fb_ms']:.0f}) | {r['tokens_s']:,.0f} | {r['tokens_s'] / first['tokens_s']:.2f}x "
              f"| {r['peak_gib']:.1f} | {diff:.1e} |")
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
