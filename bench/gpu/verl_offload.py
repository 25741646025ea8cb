"""The verl engine's `offload` (the preset's `offload: true`, TB_VERL_OFFLOAD=1), measured: peak and
resident GPU memory of the same training steps with and without it.

Two verl engines, one after the other, each over its stdio channel exactly as the agent drives it
(torchrun, `-m tinker_engine_verl`): load_base, create_model (same LoRA and seed), then `--steps`
steps of forward_backward (cross_entropy) + optim_step on the same batch. After create_model and
after every step the engine's `memory` op reports its CUDA allocator's allocated bytes (resident
between ops) and the peak since the last reading. Losses must agree between the two runs
(offload moves tensors, it does not change the arithmetic). Prints a table and writes
offload.json into --out.

  python3 bench/gpu/verl_offload.py --model DIR [--steps 3] [--batch 8] [--max-len 1024]
  (on the H200 with the verl kit on PYTHONPATH: bench/gpu/verl_sdk_check.sh gpu runs it last;
  here `--twin --model models/tiny-qwen3` checks the driver with a torch engine in verl's place)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_check import PY_DIR, EngineClient, ce_datum, make_data  # noqa: E402

GIB = 2**30


def run(offload: bool, args: argparse.Namespace, out: Path, vocab: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PY_DIR), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TB_VERL_OFFLOAD": "1" if offload else "0"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "tinker_engine_verl"]
    if args.twin:  # the driver itself, here: the torch engine on the CPU in verl's place (offload does nothing)
        argv, env["TB_ENGINE_DEVICE"] = [sys.executable, "-m", "tinker_engine"], "cpu"
    eng = EngineClient(f"verl offload={int(offload)}", argv, env, out / f"verl_offload{int(offload)}.log")
    rows: list[dict[str, Any]] = []
    try:
        eng.call("hello")
        eng.call("load_base", {"name": "base", "path": args.model})
        t = time.perf_counter()
        eng.call("create_model", {"model_id": "m", "base_model": "base",
                                  "lora": {"rank": args.rank, "seed": 7, "train_attn": True, "train_mlp": True,
                                           "train_unembed": False}})
        created_s = time.perf_counter() - t
        mem = eng.call("memory", {"reset_peak": True})
        rows.append({"after": "create_model", "allocated_gib": mem["allocated_bytes"] / GIB,
                     "peak_gib": mem["max_allocated_bytes"] / GIB, "seconds": created_s})
        data = [ce_datum(s) for s in make_data(args.batch, args.max_len // 2, args.max_len, vocab, seed=1)]
        for step in range(args.steps):
            t = time.perf_counter()
            fb = eng.call("forward_backward", {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {},
                                               "forward_only": False, "data": data})
            eng.call("optim_step", {"model_id": "m", "adam": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95,
                                                               "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}})
            dt = time.perf_counter() - t
            mem = eng.call("memory", {"reset_peak": True})
            rows.append({"after": f"step {step}", "loss": fb["metrics"]["loss:sum"], "seconds": dt,
                         "allocated_gib": mem["allocated_bytes"] / GIB, "peak_gib": mem["max_allocated_bytes"] / GIB,
                         "reserved_gib": mem["reserved_bytes"] / GIB})
            print(f"[offload={int(offload)}] {rows[-1]}", flush=True)
    finally:
        eng.close()
    return {"offload": offload, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/verl_offload_out"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--twin", action="store_true", help="check the driver on the CPU: a torch engine in verl's place")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(args.model).vocab_size)
    runs = [run(False, args, out, vocab), run(True, args, out, vocab)]
    print(f"{'':14} {'offload off':>34} {'offload on':>34}")
    print(f"{'after':14} {'resident GiB':>12} {'peak GiB':>10} {'s':>10} {'resident GiB':>12} {'peak GiB':>10} {'s':>10}   loss rel diff")
    for a, b in zip(runs[0]["rows"], runs[1]["rows"]):
        rel = (abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)) if "loss" in a else None
        print(f"{a['after']:14} {a['allocated_gib']:12.2f} {a['peak_gib']:10.2f} {a['seconds']:10.2f} "
              f"{b['allocated_gib']:12.2f} {b['peak_gib']:10.2f} {b['seconds']:10.2f}   {'' if rel is None else f'{rel:.2e}'}")
    peak = [max(r["peak_gib"] for r in run_["rows"]) for run_ in runs]
    resident = [runs[i]["rows"][-1]["allocated_gib"] for i in range(2)]
    summary = {"model": args.model, "batch": args.batch, "max_len": args.max_len, "rank": args.rank, "runs": runs,
               "peak_gib": {"off": peak[0], "on": peak[1]}, "resident_after_last_step_gib": {"off": resident[0], "on": resident[1]}}
    (out / "offload.json").write_text(json.dumps(summary, indent=1))
    print(f"[offload] peak GiB off {peak[0]:.2f} on {peak[1]:.2f}; resident between steps off {resident[0]:.2f} on {resident[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
