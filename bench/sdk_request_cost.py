"""What a sample request costs the server, through the real tinker SDK (run by bench/request-cost.ts).

    python bench/sdk_request_cost.py ratio <base_model> <n> <max_tokens> <prompt_len> <rounds>
        Rounds of A = one `sample` of n samples and B = n concurrent `sample` calls of one sample
        each, in the order A B B A (then again), so that a drift of the machine's load falls on both.
        Every call of a round uses the same prompt (prompt_len tokens) and `stop=[]`, which turns EOS
        off, so every sequence is max_tokens long: A and B decode the same tokens and differ only in
        how many requests carry them. Before and after each half the CPU time (utime + stime, Linux
        /proc) of the stack's processes named in TB_BENCH_PIDS (`name=pid,...`), each with its
        descendants not named there, is read; the half ends once the stack is idle again (see `settle`).
    python bench/sdk_request_cost.py inflight <base_model> <n> <max_tokens>
        n one-sample requests sent at once from one client; all awaited.

Prints one JSON line.
"""
import json
import os
import statistics
import sys
import time

import tinker
from procstat import settle, snapshot
from tinker import types

# A half ends once the stack used no CPU tick over 50 ms (the ends of a request, its metrics and its
# signal, land after the client has its answer), waiting at most this long.
SETTLE_S = 1.0


def ratio(base_model: str, n: int, max_tokens: int, prompt_len: int, rounds: int) -> dict:
    pids = {k: int(v) for k, v in (kv.split("=") for kv in os.environ["TB_BENCH_PIDS"].split(",") if kv)}
    sampler = tinker.ServiceClient().create_sampling_client(base_model=base_model).result()
    prompt = types.ModelInput.from_ints([5 + (j * 7) % 1000 for j in range(prompt_len)])

    def params(seed: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])

    def half_a(r: int) -> int:
        res = sampler.sample(prompt, num_samples=n, sampling_params=params(r)).result()
        return sum(len(s.tokens) for s in res.sequences)

    def half_b(r: int) -> int:
        fs = [sampler.sample(prompt, num_samples=1, sampling_params=params(r * n + k)) for k in range(n)]
        return sum(len(s.tokens) for f in fs for s in f.result().sequences)

    half_a(0)
    half_b(0)  # warm-up: both paths compiled and every connection of the SDK's pools open
    cpu: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    wall: dict[str, list[float]] = {"A": [], "B": []}
    tokens: dict[str, set[int]] = {"A": set(), "B": set()}
    order = ["A", "B", "B", "A"]
    for i in range(2 * rounds):
        half = order[i % 4]
        settle(pids, SETTLE_S)
        before, t = snapshot(pids), time.perf_counter()
        tokens[half].add((half_a if half == "A" else half_b)(i))
        wall[half].append(time.perf_counter() - t)
        settle(pids, SETTLE_S)
        after = snapshot(pids)
        cpu[half].append({k: after[k] - before[k] for k in pids})
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    per = {h: {k: mean([c[k] for c in cpu[h]]) for k in pids} for h in cpu}
    totals = {h: [sum(c.values()) for c in cpu[h]] for h in cpu}
    return {
        "cpu_ms_mean": per,
        "total_ms": totals,
        "ratio": sum(per["B"].values()) / sum(per["A"].values()),
        "ratio_of_medians": statistics.median(totals["B"]) / statistics.median(totals["A"]),
        "wall_s_median": {h: statistics.median(w) for h, w in wall.items()},
        "tokens_per_half": {h: sorted(t) for h, t in tokens.items()},
    }


def inflight(base_model: str, n: int, max_tokens: int) -> dict:
    sampler = tinker.ServiceClient().create_sampling_client(base_model=base_model).result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, stop=[])
    sampler.sample(types.ModelInput.from_ints([5, 6, 7]), num_samples=1, sampling_params=params).result()
    t = time.perf_counter()
    fs = [sampler.sample(types.ModelInput.from_ints([5 + k % 900, 6, 7, 8]), num_samples=1, sampling_params=params) for k in range(n)]
    answered, errors = 0, []
    for f in fs:
        try:
            if len(f.result().sequences[0].tokens) == max_tokens:
                answered += 1
        except Exception as e:  # noqa: BLE001 - counted and shown, not raised
            errors.append(repr(e)[:200])
    return {"sent": n, "answered": answered, "errors": errors[:5], "error_count": len(errors), "wall_s": time.perf_counter() - t}


if __name__ == "__main__":
    mode, base = sys.argv[1], sys.argv[2]
    nums = [int(a) for a in sys.argv[3:]]
    print(json.dumps(ratio(base, *nums) if mode == "ratio" else inflight(base, *nums)))
