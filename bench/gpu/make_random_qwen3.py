#!/usr/bin/env python3
"""Write a random-initialised Qwen3 model directory with the tiny tokenizer (no hub access).

    python3 bench/gpu/make_random_qwen3.py --shape 0.6b --out models/h200-qwen3-0.6b [--device cuda] [--dtype bfloat16]
    python3 bench/gpu/make_random_qwen3.py --shape 30b-a3b --config-only --out models/qwen3-30b-a3b

Shapes: ``0.6b`` and ``1.7b`` have the dimensions of the released Qwen3-0.6B / Qwen3-1.7B
checkpoints (their config.json), tied embeddings included, so the vocabulary is 151936 while the
tokenizer (``scripts/make_tiny_model.py``'s, 1029 ids) covers only the first ids: prompts built with
the tokenizer are in range, sampled ids mostly are not (nothing here decodes them). ``tiny-tied``
is the tiny test model with tied embeddings (the tokenizer's vocabulary), for CPU checks of the
tied-``lm_head`` LoRA path. Weights come from transformers' own initialisation under
``torch.manual_seed(seed)``; the directory is written with ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SHAPES: dict[str, dict] = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960, rope_theta=1_000_000.0),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960, rope_theta=1_000_000.0),
    # Qwen3-8B's dimensions (issue 31's publish timing at 8B: bench/gpu/turns_check.sh with SHAPE=8b); about
    # 16 GB of bf16 weights.
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
               max_position_embeddings=40960, rope_theta=1_000_000.0),
    # Qwen3-30B-A3B's dimensions (mixture of experts: 128 experts, 8 per token): config only
    # (--config-only), for vLLM's --load-format dummy (a preset's load_format: dummy); its bf16 weights
    # (about 61 GB) are more than the device's disk holds beside the rest.
    "30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
                    max_position_embeddings=40960, rope_theta=1_000_000.0),
    # vocab_size None: the tokenizer's length.
    "tiny-tied": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32, vocab_size=None, tie_word_embeddings=True,
                      max_position_embeddings=2048, rope_theta=10000.0),
}


def tiny_tokenizer():
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_tiny_model"] = mod
    spec.loader.exec_module(mod)
    return mod.build_tokenizer(mod.TinySpec())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", help="where the weights are initialised (cuda is much faster for 0.6b/1.7b)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true",
                    help="write config.json and the tokenizer, no weights (for vLLM's --load-format dummy); required for 30b-a3b")
    args = ap.parse_args()
    if args.shape == "30b-a3b" and not args.config_only:
        ap.error("30b-a3b is written with --config-only (its weights are about 61 GB): serve it with load_format: dummy")

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    out = Path(args.out)
    marker = out / ".complete"
    want = {"shape": args.shape, "dtype": args.dtype, "seed": args.seed, "config_only": args.config_only}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        print(f"{out}: already complete {want}")
        return
    t0 = time.time()
    tok = tiny_tokenizer()
    shape = dict(SHAPES[args.shape])
    rope_theta = shape.pop("rope_theta")
    if shape["vocab_size"] is None:
        shape["vocab_size"] = len(tok)
    moe = "num_experts" in shape
    config = (Qwen3MoeConfig if moe else Qwen3Config)(
        **shape, rope_theta=rope_theta, rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id, bos_token_id=None,
        pad_token_id=tok.pad_token_id, architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"])
    if args.config_only:
        config.dtype = args.dtype
        out.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(out)
        tok.save_pretrained(out)
        marker.write_text(json.dumps(want))
        print(f"{out}: Qwen3 {args.shape} config and tokenizer (no weights: serve with load_format: dummy)")
        return
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    marker.write_text(json.dumps(want))
    print(f"{out}: Qwen3 {args.shape} ({n / 1e6:.1f} M parameters, tied={config.tie_word_embeddings}, vocab {config.vocab_size}, "
          f"{args.dtype}) written in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
