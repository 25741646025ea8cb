"""Issue 31 item 5's anchor a user would pick instead of the broker: TRL's GRPOTrainer with vLLM
colocated in its process, on the loop bench/gpu/turns_check.py runs through the broker (and
inprocess_rl.py without it): per step 16 prompts of 64 random tokens x 8 samples x 128 new tokens
(128 samples), LoRA rank 32 on every linear layer of the decoder, one optimizer step over them,
random rewards (the broker's loop uses random advantages), no KL term (beta 0), bf16. TRL refuses a
LoRA on lm_head (it computes logprobs from lm_head.weight directly), which the broker's loop also
trains: this anchor does less work per step than the loop it is compared with. TRL's GRPOConfig
turns gradient checkpointing on by default; it is off here (--checkpointing keeps it), as in the
broker's engine.

    python3 bench/gpu/trl_grpo.py --model models/qwen3-1.7b [--steps 5] [--vllm] [--sleep]
        [--prompts 16] [--group 8] [--prompt-len 64] [--max-tokens 128] [--rank 32] [--micro 32]
        [--gpu-memory 0.35] [--out summary.json]

Prints each step's wall time and its sampled and trained tokens, then the median step (steps 1..,
step 0 warms up) and the sampled + trained tokens/s, the figure turns_check.sh prints for the broker.
The prompts are random token ids decoded to text (TRL takes text prompts), so their re-tokenized
lengths are printed too. On the CPU (no --vllm), a smoke test of the script with a tiny model:

    python bench/gpu/trl_grpo.py --model models/tiny-qwen3 --steps 2 --prompts 2 --group 2 --max-tokens 8 --micro 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StepClock(TrainerCallback):
    """Wall time of each optimizer step (generation included: TRL generates at a step's first micro-batch)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.steps: list[float] = []

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.steps.append(time.perf_counter() - self.t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--micro", type=int, default=32, help="completions per micro-batch (per_device_train_batch_size)")
    ap.add_argument("--vllm", action="store_true", help="generate with vLLM colocated (vllm_mode='colocate')")
    ap.add_argument("--sleep", action="store_true", help="vLLM sleeps while the model trains (vllm_enable_sleep_mode)")
    ap.add_argument("--gpu-memory", type=float, default=0.35, help="vllm_gpu_memory_utilization")
    ap.add_argument("--checkpointing", action="store_true",
                    help="keep TRL's default gradient checkpointing (off here: the broker's engine does not checkpoint)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    # Colocated vLLM runs under torch.distributed (one rank here), as `accelerate launch` would set up.
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(args.model)
    rng = np.random.default_rng(0)
    vocab = len(tok)
    texts = [tok.decode(rng.integers(10, vocab, args.prompt_len).tolist()) for _ in range(args.prompts * (args.steps + 1))]
    lengths = [len(tok(t).input_ids) for t in texts]
    print(f"prompts: {len(texts)} of {args.prompt_len} random tokens; re-tokenized lengths {min(lengths)}-{max(lengths)}, mean {statistics.mean(lengths):.1f}")

    tokens: list[tuple[int, int]] = []  # per reward call: (sampled, trained)

    def reward(completions, completion_ids=None, prompts=None, **kw):  # noqa: ANN001, ANN003, ANN202
        ids = completion_ids if completion_ids is not None else [tok(c).input_ids for c in completions]
        sampled = sum(len(c) for c in ids)
        prompt_tokens = sum(len(tok(p).input_ids) for p in (prompts or []))
        tokens.append((sampled, sampled + prompt_tokens))
        return rng.normal(size=len(completions)).tolist()

    per_step = args.prompts * args.group
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=max(1, per_step // args.micro),
        generation_batch_size=per_step,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        learning_rate=1e-4,
        beta=0.0,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=args.checkpointing,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        remove_unused_columns=False,
        use_vllm=args.vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.gpu_memory,
        vllm_enable_sleep_mode=args.sleep,
        vllm_max_model_length=args.prompt_len * 2 + args.max_tokens,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        peft_config=LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS, lora_dropout=0.0),
        callbacks=[clock],
    )
    t = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t
    # One reward call per generation batch (one per step here): its tokens are that step's.
    rows = [{"step": i, "step_s": s, "sampled_tokens": tokens[i][0] if i < len(tokens) else None,
             "trained_tokens": tokens[i][1] if i < len(tokens) else None} for i, s in enumerate(clock.steps)]
    for r in rows:
        print(json.dumps(r))
    timed = [r for r in rows[1:] if r["sampled_tokens"] is not None] or rows
    med = statistics.median(r["step_s"] for r in timed)
    tps = sum((r["sampled_tokens"] or 0) + (r["trained_tokens"] or 0) for r in timed) / sum(r["step_s"] for r in timed)
    summary = {"label": "trl-grpo" + ("-vllm" if args.vllm else ""), "median_step_s": med, "tokens_per_s_sampled_plus_trained": tps,
               "steps": len(rows), "reward_calls": len(tokens), "total_s": total,
               "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "steps": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
