"""An RL-shaped loop through the Tinker SDK against a stack whose actor and rollout share one GPU
(bench/gpu/turns_check.sh): each step publishes the sampler weights, samples groups of completions
on the rollout, and trains on them (importance_sampling with random advantages, the RL loss's shape)
on the actor. Prints, per step, the time of each phase and the time from the publish call to the
first token of the new version; at the end the medians and the agents' GPU turns from /metrics.

    python bench/gpu/turns_check.py --actor qwen3-1.7b --rollout qwen3-1.7b-rollout [--steps 4]
        [--prompts 16] [--group 8] [--prompt-len 64] [--max-tokens 128] [--out summary.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import urllib.request

import numpy as np
import tinker
from tinker import types


def metrics(base_url: str, prefix: str) -> list[tuple[dict[str, str], float]]:
    """The /metrics samples whose name starts with ``prefix``: (labels, value)."""
    req = urllib.request.Request(f"{base_url}/metrics", headers={"X-API-Key": os.environ.get("TINKER_API_KEY", "")})
    out = []
    for line in urllib.request.urlopen(req, timeout=10).read().decode().splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            labels = {k: v.strip('"') for k, v in (kv.split("=", 1) for kv in name[name.index("{") + 1:-1].split(","))}
            out.append((labels, float(value)))
    return out


def metrics_turns(base_url: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for labels, value in metrics(base_url, "tb_agent_gpu_turn"):
        key = labels.get("event", labels.get("phase", ""))
        out.setdefault(labels["agent"], {})[("n_" if "event" in labels else "s_") + key] = value
    return out


def metrics_engine_seconds(base_url: str) -> dict[str, float]:
    """Seconds the agents' engines spent per op so far (/metrics tb_job_duration_seconds_sum, phase engine:
    taken by an agent to finished), for the training ops' share of each step's train phase."""
    return {labels["op"]: value for labels, value in metrics(base_url, "tb_job_duration_seconds_sum{")
            if labels["phase"] == "engine"}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", required=True)
    ap.add_argument("--rollout", default="")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--out", default="")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    base_url = os.environ["TINKER_BASE_URL"]
    svc = tinker.ServiceClient()
    tc = await svc.create_lora_training_client_async(base_model=args.actor, rank=args.rank, seed=0)
    rng = np.random.default_rng(0)
    vocab = 1000  # token ids well inside any Qwen3 vocabulary
    prompts = [types.ModelInput.from_ints(rng.integers(10, vocab, args.prompt_len).tolist()) for _ in range(args.prompts)]
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    steps = []
    engine_before: dict[str, float] = {}
    for step in range(args.steps + 1):  # step 0 warms up (first loads, first turns)
        if step == 1:
            await asyncio.sleep(0.5)  # the agents write their metrics every 100 ms
            engine_before = metrics_engine_seconds(base_url)
        t0 = time.perf_counter()
        sampler = await tc.save_weights_and_get_sampling_client_async()
        t_pub = time.perf_counter()
        first = await sampler.sample_async(prompts[0], 1, types.SamplingParams(max_tokens=1, temperature=1.0))
        t_first = time.perf_counter()
        results = await asyncio.gather(*[sampler.sample_async(p, args.group, params) for p in prompts])
        t_sampled = time.perf_counter()
        data = []
        for p, r in zip(prompts, results):
            for s in r.sequences:
                toks = p.to_ints() + list(s.tokens)
                n = len(toks) - 1
                lp = np.zeros(n, dtype=np.float32)
                lp[len(p.to_ints()) - 1:] = np.array(s.logprobs, dtype=np.float32)
                adv = np.zeros(n, dtype=np.float32)
                adv[len(p.to_ints()) - 1:] = rng.standard_normal()
                data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                        loss_fn_inputs={"target_tokens": np.array(toks[1:], dtype=np.int64),
                                                        "logprobs": lp, "advantages": adv}))
        fb = await tc.forward_backward_async(data, "importance_sampling")
        opt = await tc.optim_step_async(types.AdamParams(learning_rate=1e-5))
        fbr = await fb.result_async()
        await opt.result_async()
        t_trained = time.perf_counter()
        sampled = sum(len(s.tokens) for r in results for s in r.sequences)
        trained = sum(d.model_input.length for d in data)
        row = {"step": step, "publish_s": t_pub - t0, "publish_to_first_token_s": t_first - t0,
               "sample_s": t_sampled - t_first, "train_s": t_trained - t_sampled, "step_s": t_trained - t0,
               "samples": sum(len(r.sequences) for r in results), "sampled_tokens": sampled, "trained_tokens": trained,
               "loss": fbr.metrics.get("loss:sum")}
        steps.append(row)
        print(json.dumps(row), flush=True)
        del first
    timed = steps[1:]
    await asyncio.sleep(0.5)
    engine_after = metrics_engine_seconds(base_url)
    # Per step, the engines' own seconds for each op (sample jobs overlap in a batch: their sum is not a time).
    engine_s = {op: (v - engine_before.get(op, 0.0)) / len(timed) for op, v in engine_after.items() if op != "sample"}
    med = {k: statistics.median(r[k] for r in timed) for k in ("publish_s", "publish_to_first_token_s", "sample_s", "train_s", "step_s")}
    tokens = sum(r["sampled_tokens"] + r["trained_tokens"] for r in timed) / sum(r["step_s"] for r in timed)
    train_engine = engine_s.get("forward_backward", 0.0) + engine_s.get("optim_step", 0.0)
    print(f"engine seconds per step by op: {json.dumps({k: round(v, 3) for k, v in engine_s.items()})}; "
          f"train phase {statistics.mean(r['train_s'] for r in timed):.3f} s of which the engine's forward_backward + "
          f"optim_step {train_engine:.3f} s", flush=True)
    summary = {"label": args.label, "median": med, "engine_s_per_step": engine_s, "tokens_per_s_sampled_plus_trained": tokens, "turns": metrics_turns(base_url), "steps": steps}
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
