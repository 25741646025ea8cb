#!/usr/bin/env python3
"""The verl engine through the whole stack, driven by the unchanged Tinker SDK (tinker==0.38.0),
against the torch engine, with vLLM sampling verl's sampler versions.

Start ``presets/gpu/h200_verl.yaml`` first (``bench/gpu/verl_sdk_check.sh gpu`` does it all on the
H200; ``… cpu`` runs this driver here with a torch engine in verl's place), then:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python3 bench/gpu/verl_sdk_check.py \\
      --verl NAME --torch NAME --out summary.json

The preset serves one model directory to a verl actor (``--verl``), a vLLM rollout and a torch
reference (which samples and scores verl's versions when a request asks for what only the torch
engine answers: ``prompt_alt_tokens_k``), and a byte-identical copy of the directory to a torch
actor (``--torch``), so the same SDK calls train one model on each engine.

1. Training: one LoRA client per engine (same rank, seed, targets; ``train_unembed=False``, see
   docs/engines/vllm.md on lm_head), ``--steps`` steps of forward_backward(cross_entropy) +
   optim_step on the same batch, every AdamParams field varied (lr, betas, eps, weight decay, grad
   clip on odd steps), the two engines' futures in flight together; then one importance_sampling step
   (sampler logprobs from a forward pass, positive advantages: no cancelling sum). Per step: both
   losses and their relative difference, the per-token logprobs' max |Δ|.
2. Sampling: verl's ``save_weights_for_sampler`` → ``create_sampling_client(model_path=…)``: 4 seeded
   samples with prompt logprobs and top-K through vLLM; the same sequences scored by the torch engine
   from verl's adapter (``prompt_alt_tokens_k=1``) and by the torch-trained version: max |Δ|.
3. Checkpoints: verl's ``save_state`` → ``create_training_client_from_state_with_optimizer`` → one step
   on the resumed client and on the original: the same loss.
4. Throughput of verl's version: vLLM, 32 concurrent one-sample requests and one 32-sample request,
   against the torch engine's (the reference agent, which batches concurrent requests).
5. Which engine ran the sample jobs (``/metrics``), GPU memory per agent.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_sdk_check as vsc  # noqa: E402  (its summary, routing counters and throughput phase)

SUMMARY = vsc.SUMMARY
say, record_error, Routed, max_abs = vsc.say, vsc.record_error, vsc.Routed, vsc.max_abs


def batch(rng: random.Random, n: int, length: int, vocab: int) -> list[types.Datum]:
    out = []
    for _ in range(n):
        seq = [rng.randrange(vocab) for _ in range(length + 1)]
        w = [0.0] * (length // 4) + [1.0] * (length - length // 4)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                               loss_fn_inputs={"target_tokens": np.array(seq[1:], dtype=np.int64),
                                               "weights": np.array(w, dtype=np.float32)}))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def logprobs(fb) -> list[list[float]]:
    return [list(o["logprobs"].tolist()) for o in fb.loss_fn_outputs]


def lp_diff(a, b) -> float:
    return max(max(abs(x - y) for x, y in zip(ra, rb)) for ra, rb in zip(logprobs(a), logprobs(b)))


def adam(step: int) -> types.AdamParams:
    return types.AdamParams(learning_rate=2e-4 * (1 + step), beta1=0.9, beta2=0.95 if step % 2 else 0.99,
                            eps=1e-8 if step % 2 else 1e-12, weight_decay=0.01 * step,
                            grad_clip_norm=1.0 if step % 2 else 0.0)


def train(clients: dict[str, Any], data: list[types.Datum], args) -> None:
    rows = []
    say(f"{'step':>4} {'loss torch':>14} {'loss verl':>14} {'rel diff':>9} {'max|dlp|':>9} {'s torch':>8} {'s verl':>8}")
    for step in range(args.steps):
        t0 = time.time()
        fbs = {k: c.forward_backward(data, "cross_entropy") for k, c in clients.items()}
        opts = {k: c.optim_step(adam(step)) for k, c in clients.items()}
        res, secs = {}, {}
        for k in clients:
            res[k] = fbs[k].result()
            opts[k].result()
            secs[k] = time.time() - t0
        lt, lv = res["torch"].metrics["loss:sum"], res["verl"].metrics["loss:sum"]
        row = {"step": step, "loss_torch": lt, "loss_verl": lv, "rel": rel(lt, lv),
               "logprobs_max_abs_diff": lp_diff(res["torch"], res["verl"]), "s_torch": secs["torch"], "s_verl": secs["verl"],
               "adam": adam(step).model_dump()}
        rows.append(row)
        say(f"{step:>4} {lt:14.6f} {lv:14.6f} {row['rel']:9.2e} {row['logprobs_max_abs_diff']:9.4f} {secs['torch']:8.2f} {secs['verl']:8.2f}")
    # importance_sampling: the engines' own current logprobs as the sampler's, positive advantages.
    fwd = {k: c.forward(data, "cross_entropy") for k, c in clients.items()}
    fwd = {k: f.result() for k, f in fwd.items()}
    arng = np.random.default_rng(5)
    # The same inputs for both engines: the torch engine's logprobs as the sampler's.
    is_data = [types.Datum(model_input=d.model_input,
                           loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                           "logprobs": np.array(lp, dtype=np.float32),
                                           "advantages": arng.uniform(0.5, 1.5, len(lp)).astype(np.float32)})
               for d, lp in zip(data, logprobs(fwd["torch"]))]
    fbs = {k: clients[k].forward_backward(is_data, "importance_sampling") for k in clients}
    opts = {k: clients[k].optim_step(adam(0)) for k in clients}
    res = {k: f.result() for k, f in fbs.items()}
    for o in opts.values():
        o.result()
    lt, lv = res["torch"].metrics["loss:sum"], res["verl"].metrics["loss:sum"]
    rows.append({"step": "IS", "loss_torch": lt, "loss_verl": lv, "rel": rel(lt, lv),
                 "logprobs_max_abs_diff": lp_diff(res["torch"], res["verl"])})
    say(f"{'IS':>4} {lt:14.6f} {lv:14.6f} {rows[-1]['rel']:9.2e} {rows[-1]['logprobs_max_abs_diff']:9.4f}")
    SUMMARY["training"] = {"rows": rows, "max_rel_loss_diff": max(r["rel"] for r in rows),
                           "forward_logprobs_max_abs_diff_after_steps": lp_diff(fwd["torch"], fwd["verl"])}


def resume(svc, verl_client, data: list[types.Datum]) -> None:
    t0 = time.time()
    path = verl_client.save_state(name="verl-sdk-check").result().path
    resumed = svc.create_training_client_from_state_with_optimizer(path)
    a = verl_client.forward_backward(data, "cross_entropy")
    b = resumed.forward_backward(data, "cross_entropy")
    oa, ob = verl_client.optim_step(adam(1)), resumed.optim_step(adam(1))
    la, lb = a.result().metrics["loss:sum"], b.result().metrics["loss:sum"]
    oa.result(), ob.result()
    a2, b2 = verl_client.forward(data, "cross_entropy").result(), resumed.forward(data, "cross_entropy").result()
    out = {"state_path": path, "loss_original": la, "loss_resumed": lb, "rel": rel(la, lb),
           "after_step_loss_rel": rel(a2.metrics["loss:sum"], b2.metrics["loss:sum"]), "seconds": round(time.time() - t0, 1)}
    SUMMARY["resume"] = out
    say(f"-- resume from verl's state: {json.dumps(out)}")


def sampling(svc, clients: dict[str, Any], P: list[int], args) -> dict[str, Any]:
    paths = {k: c.save_weights_for_sampler(name=f"verl-sdk-check-{k}").result().path for k, c in clients.items()}
    samplers = {k: svc.create_sampling_client(model_path=p) for k, p in paths.items()}
    v_client = samplers["verl"]
    params = types.SamplingParams(max_tokens=args.sample_tokens, temperature=1.0, seed=11, stop=[])
    out: dict[str, Any] = {"sampler_paths": paths}
    with Routed("verl version: vLLM samples"):
        v = v_client.sample(types.ModelInput.from_ints(P), 4, params, include_prompt_logprobs=True,
                            topk_prompt_logprobs=args.topk).result()
    seqs = [(list(s.tokens), list(s.logprobs or [])) for s in v.sequences]
    n = len(P)

    def torch_scores(client, label: str) -> list:
        with Routed(label):
            return [client.sample(types.ModelInput.from_ints(P + toks), 1, types.SamplingParams(max_tokens=1),
                                  include_prompt_logprobs=True, topk_prompt_logprobs=args.topk, prompt_alt_tokens_k=1).result()
                    for toks, _ in seqs]

    for label, client in (("torch engine, verl's adapter", v_client), ("torch engine, torch-trained version", samplers["torch"])):
        scored = torch_scores(client, label)
        sampled = [(lp, vsc.prompt_lp(t)[n + j]) for (toks, lps), t in zip(seqs, scored) for j, lp in enumerate(lps)]
        prompt = [(a, b) for a, b in list(zip(vsc.prompt_lp(v), vsc.prompt_lp(scored[0])))[1:n]]
        r = {"sampled_tokens_compared": len(sampled), "sampled_logprob_max_abs_diff": max_abs(sampled),
             "prompt_logprob_max_abs_diff": max_abs(prompt),
             "topk_prompt": vsc.compare_topk(vsc.topk_rows(v), vsc.topk_rows(scored[0]), 1, n),
             "sampled_logprob_range": [min(a for a, _ in sampled), max(a for a, _ in sampled)]}
        out[f"vllm vs {label}"] = r
        say(f"   vLLM (verl's version) vs {label}: {json.dumps(r)}")
    base = svc.create_sampling_client(base_model=args.verl)
    with Routed("base: vLLM prompt logprobs"):
        b = base.sample(types.ModelInput.from_ints(P), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True).result()
    out["vllm_prompt_lp_max_abs_change_vs_base"] = max_abs(list(zip(vsc.prompt_lp(v), vsc.prompt_lp(b)))[1:n])
    say(f"   verl's version vs the base model (vLLM prompt logprobs): max |change| {out['vllm_prompt_lp_max_abs_change_vs_base']}")
    SUMMARY["sampling"] = out
    return samplers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verl", required=True, help="the verl actor's model name")
    ap.add_argument("--torch", required=True, help="the torch actor's model name (a copy of the same directory)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--sample-tokens", type=int, default=24)
    ap.add_argument("--tp-n", type=int, default=32)
    ap.add_argument("--tp-prompt", type=int, default=128)
    ap.add_argument("--tp-tokens", type=int, default=128)
    ap.add_argument("--tp-rounds", type=int, default=2)
    ap.add_argument("--phases", default="train,resume,sample,throughput")
    ap.add_argument("--out", default="verl_sdk_check.json")
    args = ap.parse_args()
    SUMMARY["args"] = vars(args)
    phases = set(args.phases.split(","))
    t_start = time.time()
    svc = tinker.ServiceClient()
    caps = svc.get_server_capabilities()
    SUMMARY["models"] = [m.model_name for m in caps.supported_models]
    say(f"-- server models: {SUMMARY['models']}")
    lora = {"rank": args.rank, "seed": 0, "train_unembed": False}
    t0 = time.time()
    clients = {"torch": svc.create_lora_training_client(base_model=args.torch, **lora),
               "verl": svc.create_lora_training_client(base_model=args.verl, **lora)}
    say(f"-- training clients created in {time.time() - t0:.1f} s")
    tok = clients["torch"].get_tokenizer()
    vocab = len(tok)
    data = batch(random.Random(1), args.batch, args.seq, vocab)
    if "train" in phases:
        try:
            train(clients, data, args)
        except Exception as e:  # noqa: BLE001 - recorded, the next phase still runs
            record_error("train", e)
    # Sampler versions before the resume check, which steps the verl model once more.
    P = tok.encode("hello world, the cat sat on the mat")
    samplers: dict[str, Any] = {}
    if "sample" in phases or "throughput" in phases:
        try:
            samplers = sampling(svc, clients, P, args)
        except Exception as e:  # noqa: BLE001
            record_error("sample", e)
    if "resume" in phases:
        try:
            resume(svc, clients["verl"], data)
        except Exception as e:  # noqa: BLE001
            record_error("resume", e)
    SUMMARY["throughput"] = {}
    if "throughput" in phases and "verl" in samplers:
        rng = random.Random(0)
        try:
            samplers["verl"].sample(types.ModelInput.from_ints(P), args.tp_n, types.SamplingParams(max_tokens=8, stop=[])).result()
            SUMMARY["throughput"]["vllm"] = vsc.throughput("vllm verl-version", samplers["verl"], args, rng, vocab)
            samplers["verl"].sample(types.ModelInput.from_ints(P), 4, types.SamplingParams(max_tokens=8, stop=[]), prompt_alt_tokens_k=1).result()
            SUMMARY["throughput"]["torch"] = vsc.throughput("torch verl-version", samplers["verl"], args, rng, vocab, torch=True)
            v, t = SUMMARY["throughput"]["vllm"], SUMMARY["throughput"]["torch"]
            SUMMARY["throughput"]["vllm_concurrent_over_torch_best"] = round(
                max(v["concurrent"]) / max(max(t["concurrent"]), max(t["one_request"])), 2)
        except Exception as e:  # noqa: BLE001
            record_error("throughput", e)
    SUMMARY["gpu_memory_gib_end"] = vsc.gpu_memory()
    SUMMARY["seconds"] = round(time.time() - t_start, 1)
    Path(args.out).write_text(json.dumps(SUMMARY, indent=1))
    say("== summary ==")
    say(json.dumps({k: v for k, v in SUMMARY.items() if k != "args"}, indent=1))
    sys.exit(1 if SUMMARY["errors"] else 0)


if __name__ == "__main__":
    main()
