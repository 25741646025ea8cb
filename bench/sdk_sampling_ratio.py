"""Concurrent one-sample requests against one multi-sample request, through the real tinker SDK.

Run by `node --import tsx bench/sampling.ts sdk` (TINKER_BASE_URL and TINKER_API_KEY set):
    python bench/sdk_sampling_ratio.py <base_model> <n> <max_tokens> <prompt_len> <rounds>
Each round: one `sample` of n samples of one prompt, then n concurrent `sample` calls of one sample
each with distinct prompts of the same length (same max_tokens, `stop=[]` so every sequence runs to
max_tokens). Prints one JSON line: sampled tokens/s of both per round, their medians and the median
of the per-round ratios (a round's two halves share the machine's load of the moment), and the CPU
time each half took per round in this client (all its threads), and, where TB_BENCH_PIDS names them
(`name=pid,...`, Linux /proc), in the server's processes (the start command's API+agent, the engine,
Redis): on a machine of few cores the concurrent half is bounded by their sum.
"""
import json
import os
import statistics
import sys
import time

import tinker
from procstat import cpu_ms
from tinker import types


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    out = {"client": time.process_time() * 1000}
    for name, pid in pids.items():
        try:
            out[name] = cpu_ms(pid)
        except OSError:
            pass
    return out


def main() -> None:
    base_model = sys.argv[1]
    n, max_tokens, prompt_len, rounds = (int(a) for a in sys.argv[2:6])
    sampler = tinker.ServiceClient().create_sampling_client(base_model=base_model).result()

    def prompt(k: int) -> types.ModelInput:
        return types.ModelInput.from_ints([5 + ((k * 31 + j * 7) % 1000) for j in range(prompt_len)])

    def params(seed: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])

    pids = {k: int(v) for k, v in (kv.split("=") for kv in os.environ.get("TB_BENCH_PIDS", "").split(",") if kv)}
    sampler.sample(prompt(0), num_samples=2, sampling_params=params(0)).result()  # warm-up
    single, concurrent = [], []
    cpu: dict[str, dict[str, float]] = {"single": {}, "concurrent": {}}

    def add_cpu(half: str, before: dict[str, float]) -> None:
        after = cpu_snapshot(pids)
        for k in before.keys() & after.keys():
            cpu[half][k] = cpu[half].get(k, 0.0) + (after[k] - before[k]) / rounds

    for r in range(rounds):
        c = cpu_snapshot(pids)
        t = time.perf_counter()
        res = sampler.sample(prompt(r), num_samples=n, sampling_params=params(r)).result()
        single.append(sum(len(s.tokens) for s in res.sequences) / (time.perf_counter() - t))
        add_cpu("single", c)
        c = cpu_snapshot(pids)
        t = time.perf_counter()
        futures = [sampler.sample(prompt(1 + r * n + k), num_samples=1, sampling_params=params(k)) for k in range(n)]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        concurrent.append(tokens / (time.perf_counter() - t))
        add_cpu("concurrent", c)
    med = statistics.median
    print(json.dumps({
        "single": single, "concurrent": concurrent,
        "single_median": med(single), "concurrent_median": med(concurrent),
        "ratio_of_medians": med(concurrent) / med(single),
        "median_round_ratio": med(c / s for c, s in zip(concurrent, single)),
        "cpu_ms_per_round": cpu,
    }))


if __name__ == "__main__":
    main()
