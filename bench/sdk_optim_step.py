"""An optim_step through the real tinker SDK against two plain HTTP round trips to the same server.

Run by bench/overhead.ts (TINKER_BASE_URL and TINKER_API_KEY set):
    python bench/sdk_optim_step.py <base_model> <steps>
Prints one JSON line: medians in ms and the ratios. The two kinds alternate step by step, so load
on the machine weighs on both alike. Plain round trips: `GET /api/v1/healthz` (two Redis reads on
the server), and a `GET` of a path the server does not have (404, no Redis), each sent twice over
one keep-alive httpx client, as the SDK's own client keeps its connection.
"""
import json
import os
import statistics
import sys
import time

import httpx
import tinker


def main() -> None:
    base_model, steps = sys.argv[1], int(sys.argv[2])
    url, key = os.environ["TINKER_BASE_URL"], os.environ["TINKER_API_KEY"]
    tc = tinker.ServiceClient().create_lora_training_client(base_model=base_model, rank=8)
    adam = tinker.AdamParams(learning_rate=1e-4)
    plain = httpx.Client(base_url=url, headers={"X-API-Key": key})
    for _ in range(5):
        tc.optim_step(adam).result()
        plain.get("/api/v1/healthz")
    sdk, healthz, nf = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        tc.optim_step(adam).result()
        sdk.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        for _ in range(2):
            plain.get("/api/v1/healthz").raise_for_status()
        healthz.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        for _ in range(2):
            assert plain.get("/no-such-path").status_code == 404
        nf.append((time.perf_counter() - t) * 1000)
    med = statistics.median
    print(
        json.dumps(
            {
                "steps": steps,
                "sdk_p50_ms": med(sdk),
                "plain_healthz_p50_ms": med(healthz),
                "plain_404_p50_ms": med(nf),
                "ratio_healthz": med(sdk) / med(healthz),
                "ratio_404": med(sdk) / med(nf),
            }
        )
    )


if __name__ == "__main__":
    main()
