#!/usr/bin/env python3
"""vLLM through the broker against the same vLLM server called directly (issue 36, "Measure").

Start a stack with a vLLM rollout agent first (``bash bench/gpu/turns_check.sh direct`` does it on
the GPU, with CUDA graphs; on the CPU, ``tinker-broker start --preset presets/cpu/tiny_vllm.yaml``),
then:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local \\
      python3 bench/gpu/vllm_direct.py --rollout qwen3-1.7b-rollout --agent-log stack.log [--n 32 --tokens 128]

The vLLM server's address and served name come from the agent's log line ``vLLM serving … url=…
served_as=…``. Each round sends the same ``--n`` distinct prompts (``--prompt-len`` random token
ids) two ways, in alternating order (B D, D B, …):

- **broker**: ``--n`` concurrent one-sample ``sample`` calls of the Tinker SDK against the broker,
  by the rollout's name (the API puts each on the vLLM queue; the agent sends it to the server);
- **direct**: ``--n`` concurrent ``POST /v1/completions`` to the server, one thread each, with the
  body the vLLM agent sends (workers/adapters/vllm/translate.ts ``completionRequest``: token ids in
  and out, sampled-token logprobs, vLLM's EOS off).

Every sequence is exactly ``--tokens`` long (EOS off both ways), so both halves generate the same
number of tokens. Prints each half's tokens/s per round, the ratio broker / direct of the medians
and the median of the rounds' ratios, and how many sample jobs each engine ran (the API's /metrics;
all must be vLLM's). Exit 1 when a request failed or a sequence came back short.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import tinker
from tinker import types

from vllm_prompt_logprobs_probe import server_of
from vllm_sdk_check import jobs_by_engine, metrics_text, say


def sample_phases() -> dict[str, tuple[float, int]]:
    """The API's /metrics: per phase of the sample jobs (queue_wait, engine, total), the seconds summed and the count."""
    out: dict[str, list[float]] = {}
    for m in re.finditer(r'^tb_job_duration_seconds_(sum|count)\{([^}]*)\} (\S+)', metrics_text(), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("op") != "sample":
            continue
        acc = out.setdefault(labels.get("phase", "?"), [0.0, 0])
        acc[0 if m.group(1) == "sum" else 1] += float(m.group(3))
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def direct_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """What the vLLM agent sends for a one-sample job at temperature 1 with EOS off (translate.ts)."""
    return {
        "model": model, "prompt": prompt, "n": 1, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0,
        "repetition_penalty": 1, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "skip_special_tokens": False, "stream": False, "max_tokens": max_tokens, "temperature": 1.0,
        "top_k": -1, "top_p": 1.0, "stop_token_ids": [], "ignore_eos": True,
    }


def post(url: str, body: dict) -> tuple[int, float]:
    """One completion; the number of tokens it generated and its latency (s)."""
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return len(out["choices"][0]["token_ids"]), time.perf_counter() - t0


def run_direct(pool: ThreadPoolExecutor, url: str, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, list[float]]:
    """The tokens generated, the half's wall time, and each request's latency (s)."""
    t0 = time.perf_counter()
    done = list(pool.map(lambda p: post(url, direct_body(model, p, max_tokens)), prompts))
    return sum(n for n, _ in done), time.perf_counter() - t0, [lat for _, lat in done]


def run_broker(client, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    t0 = time.perf_counter()
    futs = [client.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts]
    outs = [f.result() for f in futs]
    return sum(len(o.sequences[0].tokens) for o in outs), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollout", required=True, help="the vLLM rollout's model name on the broker")
    ap.add_argument("--agent-log", required=True, help="the log holding the vLLM agent's 'vLLM serving' line")
    ap.add_argument("--n", type=int, default=32, help="concurrent one-sample requests per half")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (EOS off)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=0, help="prompt ids below this (default: the served model directory's vocab_size)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    url, served = server_of(args.agent_log)
    say(f"vLLM server {url}, served as {served}; broker name {args.rollout}")
    client = tinker.ServiceClient().create_sampling_client(base_model=args.rollout)
    client = client.result() if hasattr(client, "result") else client
    # The agents serve a model directory: its config's vocabulary (the tokenizer may cover only part of it).
    vocab = args.vocab or json.load(open(os.path.join(served, "config.json")))["vocab_size"]
    rng = random.Random(0)
    pool = ThreadPoolExecutor(max_workers=args.n)
    # Warm-up both ways (the first requests after a start pay for allocation and, with graphs, capture).
    warm = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.n)]
    run_direct(pool, url, served, warm, 8)
    run_broker(client, warm, 8)

    want = args.n * args.tokens
    rows: dict[str, list[float]] = {"broker": [], "direct": []}
    short: list[str] = []
    before = jobs_by_engine()
    direct_latencies: list[float] = []
    phases_before = sample_phases()
    for r in range(args.rounds):
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.n)]
        order = ("broker", "direct") if r % 2 == 0 else ("direct", "broker")
        line = []
        for way in order:
            if way == "broker":
                toks, dt = run_broker(client, prompts, args.tokens)
            else:
                toks, dt, lats = run_direct(pool, url, served, prompts, args.tokens)
                direct_latencies += lats
            if toks != want:
                short.append(f"round {r} {way}: {toks} tokens of {want}")
            rows[way].append(toks / dt)
            line.append(f"{way} {toks / dt:,.0f} tok/s ({dt:.2f} s)")
        say(f"round {r}: " + "; ".join(line) + f"; broker / direct {rows['broker'][-1] / rows['direct'][-1]:.3f}")
    after = jobs_by_engine()
    jobs = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    # Where a broker request's time goes, as means over the timed rounds' sample jobs: queue_wait (the
    # API stored the job → the agent took it), engine (taken → the agent had vLLM's answer recorded),
    # against a direct request's latency. What the burst adds beyond these is the client's and the
    # API's side (sending, the answer's trip back through retrieve_futures).
    phases_after = sample_phases()
    phase_ms = {}
    for k, (total, count) in phases_after.items():
        t0, c0 = phases_before.get(k, (0.0, 0))
        if count > c0:
            phase_ms[k] = round(1000 * (total - t0) / (count - c0), 1)
    direct_ms = round(1000 * statistics.mean(direct_latencies), 1) if direct_latencies else None
    say(f"broker sample jobs, mean ms by phase: {phase_ms}; direct requests, mean latency {direct_ms} ms")
    med = {k: statistics.median(v) for k, v in rows.items()}
    summary = {
        "n": args.n, "tokens": args.tokens, "prompt_len": args.prompt_len, "rounds": args.rounds,
        "tokens_per_s": {k: [round(x, 1) for x in v] for k, v in rows.items()},
        "median_tokens_per_s": {k: round(v, 1) for k, v in med.items()},
        "ratio_of_medians": round(med["broker"] / med["direct"], 3),
        "median_of_round_ratios": round(statistics.median(b / d for b, d in zip(rows["broker"], rows["direct"])), 3),
        "sample_jobs_by_engine": jobs,
        "broker_phase_mean_ms": phase_ms,
        "direct_mean_latency_ms": direct_ms,
        "short": short,
    }
    say("SUMMARY " + json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    # Every broker request must have gone to vLLM (one sample job each), and every sequence be whole.
    ok = not short and jobs.get("torch", 0) == 0 and jobs.get("vllm", 0) >= args.n * args.rounds
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
