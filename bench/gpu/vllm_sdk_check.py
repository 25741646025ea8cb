#!/usr/bin/env python3
"""The vLLM engine beside a torch actor, driven by the unchanged Tinker SDK (tinker==0.38.0).

Start a preset with a torch actor and a vLLM rollout agent on one model directory first
(``presets/gpu/h200_vllm.yaml`` on one GPU, ``presets/cpu/tiny_vllm.yaml`` on the CPU;
``bench/gpu/vllm_sdk_check.sh`` does it all on the H200), then:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local \\
      python3 bench/gpu/vllm_sdk_check.py --actor qwen3-0.6b-rand --rollout qwen3-0.6b-rand-rollout --out summary.json

What it does, in order (every figure goes into the summary; a failing step is recorded, not fatal):

1. Three LoRA training clients on the actor: ``all`` (attention + MLP + ``lm_head``, the SDK's default
   ``train_unembed=True``), ``unembed`` (``lm_head`` only) and ``attn_mlp`` (``train_unembed=False``). Each trains ``--steps`` steps on one
   datum (a prompt and its completion + EOS), then ``save_weights_for_sampler``; the sampling
   clients come from those paths (``create_sampling_client(model_path=…)``) and the base model from
   the rollout's name (``create_sampling_client(base_model=rollout)``).
2. Per target (base and the three versions): one vLLM request (4 seeded samples at temperature 1,
   per-token logprobs, prompt logprobs, top-K prompt logprobs), then the torch engine's scores of the
   same sequences: ``sample(prompt + tokens, max_tokens=1, include_prompt_logprobs, topk_prompt_logprobs,
   prompt_alt_tokens_k=1)`` — the API sends requests with ``prompt_alt_tokens_k`` to a torch agent,
   so the same sampler version is scored by the torch actor. Reported: max |vLLM − torch| of the
   sampled tokens' logprobs, of the prompt logprobs, of vLLM's own ``compute_logprobs`` of the whole
   sequences, and of the top-K rows (values of the ids both rows hold, id agreement); a refusal of
   prompt logprobs by the vLLM engine is recorded and the sampled tokens are still compared. Greedy
   samples of the trained prompt from both engines (the same tokens? the trained completion?). For
   the LoRA targets, how far vLLM's prompt logprobs are from the base model's.
3. compute_logprobs of every target's sequences again, while sampling requests of every target run
   (``--mixed-tokens`` each): the values must equal those computed alone (vLLM computes prompt logprobs
   with one LoRA row per sampled sequence of the step, docs/engines/vllm.md).
4. Throughput through the SDK (``--tp-rounds`` rounds per target, base by the rollout's name and the
   ``all`` version): one request of ``--tp-n`` samples against ``--tp-n`` concurrent one-sample
   requests (distinct prompts of ``--tp-prompt`` tokens, exactly ``--tp-tokens`` new tokens each,
   ``stop=[]``); tokens/s and their ratio. ``--torch-tp``: the same two shapes on the torch actor
   (``prompt_alt_tokens_k=1`` routes them there), once.
5. Which engine ran the sample jobs: the API's ``/metrics`` (``tb_queue_jobs`` of the
   ``sample-…-vllm`` and ``sample-…-torch`` queues) before and after each phase; GPU memory per agent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
import traceback
import urllib.request
from typing import Any

import numpy as np
import tinker
from tinker import types

SUMMARY: dict[str, Any] = {"errors": {}}


def say(msg: str) -> None:
    print(msg, flush=True)


def record_error(step: str, e: BaseException) -> None:
    SUMMARY["errors"][step] = f"{type(e).__name__}: {e}"
    say(f"!! {step}: {type(e).__name__}: {e}")
    traceback.print_exc(limit=3)


# --- the API's metrics --------------------------------------------------------------------------

def metrics_text() -> str:
    base = os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000").rstrip("/")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        return r.read().decode()


def jobs_by_engine() -> dict[str, int]:
    """Sample jobs finished (completed + failed) on the sample queues of each engine."""
    out = {"vllm": 0, "torch": 0}
    for m in re.finditer(r'^tb_queue_jobs\{queue="sample-[0-9a-f]+-(\w+)",state="(completed|failed)"\} (\d+)', metrics_text(), re.M):
        out[m.group(1)] = out.get(m.group(1), 0) + int(m.group(3))
    return out


def gpu_memory() -> dict[str, float]:
    out = {}
    for m in re.finditer(r'^tb_agent_gpu_memory_bytes\{agent="([^"]+)",engine="(\w+)",device="([^"]*)"\} (\S+)', metrics_text(), re.M):
        out[f"{m.group(1)} ({m.group(2)}, {m.group(3)})"] = round(float(m.group(4)) / 2**30, 2)
    return out


class Routed:
    """Counts the sample jobs each engine ran during a `with` block."""

    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        self.before = jobs_by_engine()
        return self

    def __exit__(self, *exc):
        after = jobs_by_engine()
        d = {k: after.get(k, 0) - self.before.get(k, 0) for k in set(after) | set(self.before)}
        SUMMARY.setdefault("jobs_by_engine", {})[self.label] = d
        say(f"   sample jobs run in '{self.label}': {d}")
        return False


# --- helpers ------------------------------------------------------------------------------------

def max_abs(pairs: list[tuple[float, float]]) -> float | None:
    vals = [abs(a - b) for a, b in pairs if a is not None and b is not None and not (math.isnan(a) or math.isnan(b))]
    return max(vals) if vals else None


def topk_rows(res: types.SampleResponse) -> list[list[tuple[int, float]] | None]:
    return [None if row is None else [(int(i), float(lp)) for i, lp in row] for row in (res.topk_prompt_logprobs or [])]


def compare_topk(v: list, t: list, start: int, end: int) -> dict[str, Any]:
    diffs, top1_same, overlap, rows = [], 0, 0, 0
    for i in range(start, end):
        if v[i] is None or t[i] is None:
            continue
        rows += 1
        dv, dt = dict(v[i]), dict(t[i])
        diffs += [abs(dv[k] - dt[k]) for k in dv.keys() & dt.keys()]
        overlap += len(dv.keys() & dt.keys())
        top1_same += int(v[i][0][0] == t[i][0][0])
    k = len(v[start]) if rows and v[start] else 0
    return {"rows": rows, "k": k, "max_abs_diff_common_ids": max(diffs) if diffs else None,
            "top1_same": f"{top1_same}/{rows}", "ids_in_both": f"{overlap}/{rows * k}"}


def prompt_lp(res: types.SampleResponse) -> list[float | None]:
    return list(res.prompt_logprobs or [])


# --- phases -------------------------------------------------------------------------------------

def train(tc, label: str, args, P: list[int], C: list[int], lora: dict) -> str:
    t0 = time.time()
    full = P + C
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64),
                        "weights": np.array([0.0] * (len(P) - 1) + [1.0] * len(C), dtype=np.float32)},
    )
    losses = []
    for _ in range(args.steps):
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
        losses.append(fb.result().metrics["loss:sum"] / len(C))
        opt.result()
    path = tc.save_weights_for_sampler(name=f"vllm-check-{label}").result().path
    SUMMARY.setdefault("training", {})[label] = {
        "lora": {"rank": args.rank, **lora}, "steps": args.steps, "lr": args.lr,
        "loss_per_token_first": losses[0], "loss_per_token_last": losses[-1], "sampler_path": path,
        "seconds": round(time.time() - t0, 1)}
    say(f"-- trained '{label}' {lora or '(attn+mlp+unembed)'}: loss/token {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"in {args.steps} steps ({time.time() - t0:.1f} s); sampler {path}")
    return path


def score_target(label: str, client, P: list[int], C: list[int], args, base_prompt_lp: list | None) -> dict[str, Any]:
    """vLLM samples with logprobs, then the torch engine scores the same sequences."""
    out: dict[str, Any] = {}
    K = args.topk
    full = P + C
    params = types.SamplingParams(max_tokens=args.sample_tokens, temperature=1.0, seed=11, stop=[])
    with Routed(f"{label}: vLLM samples"):
        t0 = time.time()
        try:
            v = client.sample(types.ModelInput.from_ints(full), 4, params, include_prompt_logprobs=True, topk_prompt_logprobs=K).result()
        except Exception as e:  # noqa: BLE001 - the vLLM engine refuses prompt logprobs it cannot give right
            out["vllm_prompt_logprobs_error"] = f"{type(e).__name__}: {e}"
            v = client.sample(types.ModelInput.from_ints(full), 4, params).result()
        out["vllm_sample_s"] = round(time.time() - t0, 3)
        seqs = [(list(s.tokens), list(s.logprobs or [])) for s in v.sequences]
        greedy = client.sample(types.ModelInput.from_ints(P), 1,
                               types.SamplingParams(max_tokens=len(C), temperature=0.0)).result().sequences[0]
        # vLLM's own compute_logprobs of the same sequences (prompt-logprob path).
        try:
            v_scored = [client.compute_logprobs(types.ModelInput.from_ints(full + toks)).result() for toks, _ in seqs]
        except Exception as e:  # noqa: BLE001
            out["vllm_compute_logprobs_error"] = f"{type(e).__name__}: {e}"
            v_scored = None
    with Routed(f"{label}: torch scores"):
        t_scored = [client.sample(types.ModelInput.from_ints(full + toks), 1, types.SamplingParams(max_tokens=1, temperature=1.0),
                                  include_prompt_logprobs=True, topk_prompt_logprobs=K, prompt_alt_tokens_k=1).result()
                    for toks, _ in seqs]
        t_greedy = client.sample(types.ModelInput.from_ints(P), 1, types.SamplingParams(max_tokens=len(C), temperature=0.0),
                                 prompt_alt_tokens_k=1).result().sequences[0]
    n = len(full)
    sampled = []
    for (toks, lps), t in zip(seqs, t_scored):
        tl = prompt_lp(t)
        sampled += [(lps[j], tl[n + j]) for j in range(len(toks))]
    out["sampled_tokens_compared"] = len(sampled)
    out["sampled_logprob_max_abs_diff"] = max_abs(sampled)
    out["sampled_logprob_range"] = [min(a for a, _ in sampled), max(a for a, _ in sampled)]
    tl0 = prompt_lp(t_scored[0])
    vl = prompt_lp(v) if v.prompt_logprobs else None
    out["torch_prompt_logprob_range"] = [min(x for x in tl0[1:]), max(x for x in tl0[1:])]
    if vl:
        out["prompt_logprob_max_abs_diff"] = max_abs([(vl[i], tl0[i]) for i in range(1, n)])
        out["prompt_logprob_range"] = [min(x for x in vl[1:]), max(x for x in vl[1:])]
        out["topk_prompt"] = compare_topk(topk_rows(v), topk_rows(t_scored[0]), 1, n)
    if v_scored is not None:
        out["compute_logprobs_max_abs_diff"] = max_abs([(a, b) for vs, t in zip(v_scored, t_scored) for a, b in list(zip(vs, prompt_lp(t)))[1:]])
    out["greedy_vllm_is_completion"] = list(greedy.tokens) == C
    out["greedy_torch_is_completion"] = list(t_greedy.tokens) == C
    out["greedy_same_tokens"] = list(greedy.tokens) == list(t_greedy.tokens)
    if base_prompt_lp is not None and vl:
        out["vllm_prompt_lp_max_abs_change_vs_base"] = max_abs([(vl[i], base_prompt_lp[i]) for i in range(1, n)])
        # On the completion positions: the adapter's effect where it was trained.
        out["vllm_completion_lp_mean_change_vs_base"] = float(np.mean([vl[i] - base_prompt_lp[i] for i in range(len(P), n)]))
    say(f"   {label}: " + json.dumps({k: v for k, v in out.items()}))
    out["_prompt_lp"] = vl
    out["_scored"] = [(full + toks, vs) for (toks, _), vs in zip(seqs, v_scored)] if v_scored is not None else None
    return out


def mixed(samplers: dict, scored: dict, P: list[int], args) -> dict[str, Any]:
    """compute_logprobs of every target while samples of every target run (the RL pattern): the same values as alone."""
    t0 = time.time()
    with Routed("mixed: compute_logprobs during sampling"):
        burst = [c.sample(types.ModelInput.from_ints(P), 2, types.SamplingParams(max_tokens=args.mixed_tokens, temperature=1.0, seed=i, stop=[]))
                 for i in range(4) for c in samplers.values()]
        again = {label: [samplers[label].compute_logprobs(types.ModelInput.from_ints(seq)) for seq, _ in scored[label]] for label in scored}
        burst += [c.sample(types.ModelInput.from_ints(P), 2, types.SamplingParams(max_tokens=args.mixed_tokens, temperature=1.0, seed=10 + i, stop=[]))
                  for i in range(4) for c in samplers.values()]
        sampled = sum(len(s.tokens) for f in burst for s in f.result().sequences)
        out: dict[str, Any] = {"samples": 2 * len(burst), "tokens_sampled": sampled}
        for label, futs in again.items():
            pairs = [(a, b) for f, (_, alone) in zip(futs, scored[label]) for a, b in list(zip(f.result(), alone))[1:]]
            out[f"{label}_compute_logprobs_max_abs_diff_vs_alone"] = max_abs(pairs)
    out["seconds"] = round(time.time() - t0, 2)
    say(f"   mixed: {json.dumps(out)}")
    return out


def throughput(label: str, client, args, rng: random.Random, vocab: int, torch: bool = False) -> dict[str, Any]:
    extra = {"prompt_alt_tokens_k": 1} if torch else {}
    params = types.SamplingParams(max_tokens=args.tp_tokens, temperature=1.0, stop=[])
    prompt = lambda: types.ModelInput.from_ints([rng.randrange(vocab) for _ in range(args.tp_prompt)])  # noqa: E731
    rounds = 1 if torch else args.tp_rounds
    res: dict[str, Any] = {"one_request": [], "concurrent": []}
    with Routed(f"throughput {label}"):
        for r in range(rounds):
            t0 = time.time()
            out = client.sample(prompt(), args.tp_n, params, **extra).result()
            dt = time.time() - t0
            toks = sum(len(s.tokens) for s in out.sequences)
            res["one_request"].append(round(toks / dt, 1))
            t0 = time.time()
            futs = [client.sample(prompt(), 1, params, **extra) for _ in range(args.tp_n)]
            outs = [f.result() for f in futs]
            dt2 = time.time() - t0
            toks2 = sum(len(o.sequences[0].tokens) for o in outs)
            res["concurrent"].append(round(toks2 / dt2, 1))
            say(f"   {label} round {r}: 1 x {args.tp_n} samples {toks / dt:.0f} tok/s ({toks} tokens, {dt:.2f} s); "
                f"{args.tp_n} x 1 concurrent {toks2 / dt2:.0f} tok/s ({toks2} tokens, {dt2:.2f} s); ratio {toks2 / dt2 / (toks / dt):.2f}")
    res["ratio"] = [round(c / o, 2) for c, o in zip(res["concurrent"], res["one_request"])]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", required=True, help="the actor's model name (trains)")
    ap.add_argument("--rollout", required=True, help="the vLLM rollout's model name (the same directory)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--sample-tokens", type=int, default=24)
    ap.add_argument("--mixed-tokens", type=int, default=64, help="tokens per sample of the burst that runs during compute_logprobs")
    ap.add_argument("--tp-n", type=int, default=32)
    ap.add_argument("--tp-prompt", type=int, default=128)
    ap.add_argument("--tp-tokens", type=int, default=128)
    ap.add_argument("--tp-rounds", type=int, default=3)
    ap.add_argument("--torch-tp", action="store_true", help="also measure the torch actor's sampling throughput (once)")
    ap.add_argument("--phases", default="compare,mixed,throughput", help="which of compare, mixed, throughput run (training always does)")
    ap.add_argument("--out", default="vllm_sdk_check.json")
    args = ap.parse_args()
    SUMMARY["args"] = vars(args)
    SUMMARY["tinker"] = tinker.__version__ if hasattr(tinker, "__version__") else "?"
    t_start = time.time()

    svc = tinker.ServiceClient()
    caps = tinker.RestClient().get_server_capabilities().result() if hasattr(tinker, "RestClient") else svc.get_server_capabilities()
    SUMMARY["models"] = [(m.model_name, getattr(m, "trainable", None)) for m in caps.supported_models]
    say(f"-- server models: {SUMMARY['models']}")

    loras = {"all": {}, "unembed": {"train_attn": False, "train_mlp": False, "train_unembed": True},
             "attn_mlp": {"train_unembed": False}}
    trainers = {label: svc.create_lora_training_client(base_model=args.actor, rank=args.rank, seed=0, **lora).result()
                for label, lora in loras.items()}
    # The tokenizer the server names (get_info: the model directory); its ids may cover only part of the model's vocabulary.
    tok = trainers["all"].get_tokenizer()
    eos = tok.eos_token_id
    P = tok.encode("hello world, the cat")
    C = tok.encode(" sat on the mat") + [eos]
    SUMMARY["prompt"] = {"P": P, "C": C}

    samplers: dict[str, Any] = {"base": svc.create_sampling_client(base_model=args.rollout).result()}
    for label, lora in loras.items():
        try:
            path = train(trainers[label], label, args, P, C, lora)
            samplers[label] = svc.create_sampling_client(model_path=path).result()
        except Exception as e:  # noqa: BLE001
            record_error(f"train {label}", e)

    phases = set(args.phases.split(","))
    SUMMARY["compare"] = {}
    base_lp = None
    scored: dict[str, Any] = {}
    for label, client in (samplers.items() if {"compare", "mixed"} & phases else []):
        try:
            r = score_target(label, client, P, C, args, base_lp if label != "base" else None)
            if label == "base":
                base_lp = r["_prompt_lp"]
            r.pop("_prompt_lp")
            if r.get("_scored") is not None:
                scored[label] = r["_scored"]
            r.pop("_scored")
            SUMMARY["compare"][label] = r
        except Exception as e:  # noqa: BLE001
            record_error(f"compare {label}", e)
    if "mixed" in phases:
        try:
            SUMMARY["mixed"] = mixed(samplers, scored, P, args)
        except Exception as e:  # noqa: BLE001
            record_error("mixed", e)

    SUMMARY["gpu_memory_gib_after_compare"] = gpu_memory()
    SUMMARY["throughput"] = {}
    rng = random.Random(0)
    vocab = len(tok)
    # Warm-up of each target: the adapter loads and kernels compile outside the timed rounds.
    for label in ("base", "all"):
        if label in samplers and "throughput" in phases:
            try:
                samplers[label].sample(types.ModelInput.from_ints(P), args.tp_n, types.SamplingParams(max_tokens=8, stop=[])).result()
                SUMMARY["throughput"][f"vllm {label}"] = throughput(f"vllm {label}", samplers[label], args, rng, vocab)
            except Exception as e:  # noqa: BLE001
                record_error(f"throughput {label}", e)
    if args.torch_tp and "all" in samplers and "throughput" in phases:
        try:
            SUMMARY["throughput"]["torch all"] = throughput("torch all", samplers["all"], args, rng, vocab, torch=True)
        except Exception as e:  # noqa: BLE001
            record_error("throughput torch", e)
    SUMMARY["gpu_memory_gib_end"] = gpu_memory()
    SUMMARY["seconds"] = round(time.time() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(SUMMARY, f, indent=1)
    say("== summary ==")
    say(json.dumps(SUMMARY, indent=1))
    sys.exit(1 if SUMMARY["errors"] else 0)


if __name__ == "__main__":
    main()
