"""Concurrent one-sample requests against one multi-sample request, through the real tinker SDK.

Run by `node --import tsx bench/sampling.ts sdk` (TINKER_BASE_URL and TINKER_API_KEY set):
    python bench/sdk_sampling_ratio.py <base_model> <n> <max_tokens> <prompt_len> <rounds>
Each round: one `sample` of n samples of one prompt, then n concurrent `sample` calls of one sample
each with distinct prompts of the same length (same max_tokens, `stop=[]` so every sequence runs to
max_tokens). Prints one JSON line: sampled tokens/s of both per round, their medians and the median
of the per-round ratios (a round's two halves share the machine's load of the moment).
"""
import json
import statistics
import sys
import time

import tinker
from tinker import types


def main() -> None:
    base_model = sys.argv[1]
    n, max_tokens, prompt_len, rounds = (int(a) for a in sys.argv[2:6])
    sampler = tinker.ServiceClient().create_sampling_client(base_model=base_model).result()

    def prompt(k: int) -> types.ModelInput:
        return types.ModelInput.from_ints([5 + ((k * 31 + j * 7) % 1000) for j in range(prompt_len)])

    def params(seed: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])

    sampler.sample(prompt(0), num_samples=2, sampling_params=params(0)).result()  # warm-up
    single, concurrent = [], []
    for r in range(rounds):
        t = time.perf_counter()
        res = sampler.sample(prompt(r), num_samples=n, sampling_params=params(r)).result()
        single.append(sum(len(s.tokens) for s in res.sequences) / (time.perf_counter() - t))
        t = time.perf_counter()
        futures = [sampler.sample(prompt(1 + r * n + k), num_samples=1, sampling_params=params(k)) for k in range(n)]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        concurrent.append(tokens / (time.perf_counter() - t))
    med = statistics.median
    print(json.dumps({
        "single": single, "concurrent": concurrent,
        "single_median": med(single), "concurrent_median": med(concurrent),
        "ratio_of_medians": med(concurrent) / med(single),
        "median_round_ratio": med(c / s for c, s in zip(concurrent, single)),
    }))


if __name__ == "__main__":
    main()
