"""Every loss of docs/engine-protocol.md, checked against a torch reference computed here.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_losses.py MODEL_ALIAS BASE_MODEL_DIR STORAGE_DIR

For each case: a fresh LoRA training client (rank 4, fixed seed) saves its initial weights for the
sampler, runs one forward_backward with the case's loss and one optim_step (AdamW), and saves its
weights again. Only the tinker SDK talks to the server. The reference loads the base model and the
*initial* adapter from STORAGE_DIR with transformers + PEFT, computes the target logprobs, the loss
(written out here from the formulas, sums, never means), its gradient, the optional global-norm
clip and the AdamW step in float32 on the CPU. Prints one JSON object with, per case, how far the
server's logprobs, loss:sum, grad_norm and updated LoRA tensors are from the reference.

Adam's first step is lr * g / (|g| + eps) (after bias correction). With Tinker's usual eps = 1e-8
it is about lr * sign(g): it would hide a wrong gradient magnitude (a mean instead of a sum, a clip
that never happened), and an entry whose gradient is ~1e-8 (sums that nearly cancel) turns float
rounding noise into parameter differences of 1e-5 and more. So the cases use eps = 1e-2 (the update
grows with |g| up to |g| ~ 1e-2; clipping scales every entry into that range) or 1e-4 (closer to
sign(g), still at most lr / eps = 100 times the gradient's rounding error). grad_norm (before
clipping) is compared as well.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
import tinker
import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from tinker import types
from transformers import AutoModelForCausalLM

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)

RANK = 4
SEED = 4242
LR = 1e-2
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
LENGTHS = (5, 9, 12)  # model input tokens per datum
K = 3  # top-K width of the (N, K) cross_entropy case

# Offsets d with q = lp_init + d, so the ratio r = exp(lp - q) = exp(-d) at the initial weights
# (a fresh LoRA adapter has B = 0, so its logprobs are the base model's). The ratios cover
# 0.37 .. 3.3, each well away from the clip bounds 0.9 / 1.1.
RATIO_OFFSETS = np.array([1.0, 0.5, 0.2, 0.03, 0.0, -0.03, -0.2, -0.8, -1.2], dtype=np.float32)
# Advantages of both signs.
ADVANTAGES = np.array([1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 2.0, -1.5, 0.75], dtype=np.float32)

# name, loss_fn, loss_fn_config, target kind, grad_clip_norm, adam eps
CASES = [
    ("cross_entropy", "cross_entropy", None, "ce_1d", 0.0, 1e-2),
    ("cross_entropy_topk", "cross_entropy", None, "ce_topk", 0.05, 1e-2),
    ("cross_entropy_negative", "cross_entropy", None, "ce_negative", 0.0, 1e-4),
    ("importance_sampling", "importance_sampling", None, "rl", 0.05, 1e-2),
    ("ppo", "ppo", CLIP, "rl", 0.0, 1e-2),
    ("cispo", "cispo", CLIP, "rl", 0.05, 1e-2),
    ("dro", "dro", {"beta": 0.5}, "rl", 0.0, 1e-4),
    # SDK 0.38: per-token thresholds, cispo's one-sided default, gspo, stable_reinforce.
    ("ppo_per_token", "ppo", CLIP, "rl_clip_tokens", 0.0, 1e-2),
    ("cispo_default", "cispo", None, "rl", 0.05, 1e-2),
    ("gspo", "gspo", None, "gspo", 0.0, 1e-2),
    ("gspo_thresholds", "gspo", {"clip_low_threshold": 0.6, "clip_high_threshold": 1.6}, "gspo_clip_tokens", 0.0, 1e-2),
    ("stable_reinforce", "stable_reinforce", {"kl_coeff": 2.0}, "stable", 0.0, 1e-2),
]


def adapter_dir(storage: str, model_id: str, name: str) -> str:
    return os.path.join(storage, re.sub(r"[^A-Za-z0-9._-]", "_", model_id), "sampler_weights", name)


def load_base(base_dir: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    return model.eval()


def target_logprobs(model: torch.nn.Module, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:
    """log p(targets) for one unpadded sequence: float32 log-softmax gathered at (N,) or (N, K) targets."""
    logits = model(input_ids=torch.tensor(tokens, dtype=torch.int64)[None], use_cache=False).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    t = torch.tensor(targets, dtype=torch.int64)
    if t.dim() == 1:
        return logp[torch.arange(t.shape[0]), t]
    return torch.gather(logp, 1, t)


# ---- the loss formulas of docs/engine-protocol.md, per datum, as sums ----

def thresholds(loss_fn: str, config: dict | None, inputs: dict[str, torch.Tensor], like: torch.Tensor):
    """(lo, hi) per token: the datum's own where it has them, else the config's, else the loss's default."""
    cfg = {**CLIP_DEFAULTS.get(loss_fn, {}), **(config or {})}
    lo = inputs.get("clip_low_threshold", torch.full_like(like, cfg.get("clip_low_threshold", 0.0)))
    hi = inputs.get("clip_high_threshold", torch.full_like(like, cfg["clip_high_threshold"]))
    return lo, hi


def ppo_objective(ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    clipped = torch.maximum(torch.minimum(ratio, hi), lo)
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def ref_loss(loss_fn: str, config: dict | None, lp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    cfg = config or {}
    if loss_fn == "cross_entropy":
        w = inputs.get("weights", torch.ones_like(lp))
        return -(w * lp).sum()
    adv = inputs["advantages"]
    if loss_fn == "stable_reinforce":
        # q: what the server recorded when it sampled (the datum's own logprobs are not used).
        m = inputs["recorded_mask"]
        log_r = (lp - inputs["recorded_logprobs"]) * m
        r = torch.exp(log_r)
        _, hi = thresholds(loss_fn, config, inputs, lp)
        w = torch.minimum(r, hi).detach()
        return -(w * adv * lp * m).sum() + cfg.get("kl_coeff", 0.0) * ((r - 1.0 - log_r) * m).sum()
    q = inputs["logprobs"]
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "ppo":
        return ppo_objective(ratio, adv, *thresholds(loss_fn, config, inputs, lp))
    if loss_fn == "cispo":
        lo, hi = thresholds(loss_fn, config, inputs, lp)
        weight = torch.maximum(torch.minimum(ratio, hi), lo).detach()
        return -(weight * lp * adv).sum()
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    if loss_fn == "gspo":
        # GSPO-token (Tinker's GSPO docs): every token carries the sequence ratio's value over
        # the masked tokens and the gradient of its own log-probability.
        m = inputs["sequence_ratio_mask"] != 0
        seq = torch.exp((lp.detach() - q)[m].mean())
        return ppo_objective(seq * torch.exp(lp - lp.detach()), adv, *thresholds(loss_fn, config, inputs, lp))
    raise ValueError(loss_fn)


# Defaults per loss (docs/losses.md).
CLIP_DEFAULTS = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "gspo": {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
    "stable_reinforce": {"clip_high_threshold": 4.0},
}


def make_data(kind: str, rng: np.random.Generator, base_lp: list[np.ndarray] | None, seqs: list[np.ndarray]):
    """(tokens, inputs) per datum; inputs are numpy arrays (targets int64, the rest float32)."""
    out = []
    for i, seq in enumerate(seqs):
        tokens, nxt = seq[:-1], seq[1:]
        n = len(tokens)
        if kind == "ce_1d":
            w = rng.uniform(0.2, 1.5, size=n).astype(np.float32)
            w[rng.integers(0, n)] = 0.0
            inputs = {"target_tokens": nxt.astype(np.int64), "weights": w}
        elif kind == "ce_negative":
            w = rng.uniform(0.2, 1.5, size=n).astype(np.float32)
            w[::3] *= -1.0
            inputs = {"target_tokens": nxt.astype(np.int64), "weights": w}
        elif kind == "ce_topk":
            targets = np.stack([rng.choice(1000, size=K, replace=False) for _ in range(n)]).astype(np.int64)
            targets[:, 0] = nxt
            w = rng.dirichlet(np.ones(K), size=n).astype(np.float32)
            inputs = {"target_tokens": targets, "weights": w}
        elif kind in ("rl", "rl_clip_tokens", "gspo", "gspo_clip_tokens"):
            assert base_lp is not None
            idx = (np.arange(n) + i) % len(RATIO_OFFSETS)
            inputs = {
                "target_tokens": nxt.astype(np.int64),
                "logprobs": (base_lp[i] + RATIO_OFFSETS[idx]).astype(np.float32),
                "advantages": ADVANTAGES[(np.arange(n) * 2 + i) % len(ADVANTAGES)].copy(),
            }
            if kind.startswith("gspo"):
                # A two-token "prompt" outside the sequence ratio, with no advantage.
                mask = np.ones(n, dtype=np.float32)
                mask[:2] = 0.0
                inputs["sequence_ratio_mask"] = mask
                inputs["advantages"] = inputs["advantages"] * mask
            if kind.endswith("clip_tokens"):
                # Per-token thresholds that differ from the config's and from each other.
                inputs["clip_low_threshold"] = np.linspace(0.4, 0.95, n).astype(np.float32)
                inputs["clip_high_threshold"] = np.linspace(1.05, 2.5, n).astype(np.float32)
        else:
            raise ValueError(kind)
        out.append((tokens.astype(np.int64), inputs))
    return out


REF_ONLY = ("recorded_logprobs", "recorded_mask", "provenance")


def to_datum(tokens: np.ndarray, inputs: dict) -> types.Datum:
    d = types.Datum(
        model_input=types.ModelInput.from_ints([int(t) for t in tokens]),
        loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items() if k not in REF_ONLY},
    )
    if "provenance" in inputs:
        d = d.with_provenance(*inputs["provenance"])
    return d


def stable_data(tc, name: str, seqs: list[np.ndarray]):
    """Datums built from real samples of the initial weights, recorded for stable_reinforce.

    As the cookbook's rl_loop does: input = prompt + sampled[:-1], targets = prompt[1:] + sampled,
    advantages only on sampled tokens, provenance naming each sequence. The datum's own
    `logprobs` are deliberately off by 0.5: the server must use what it recorded, which the
    reference takes from the sampled sequence (sequence.logprobs is what the sampler returned)."""
    sampler = tc.create_sampling_client(tc.save_weights_for_sampler(f"stable-{name}").result().path,
                                        record_stability_info=True).result()
    out = []
    for i, seq in enumerate(seqs):
        prompt = [int(t) for t in seq[:4]]
        resp = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                              types.SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i, stop=[])).result()
        for j, s in enumerate(resp.sequences):
            sampled = list(s.tokens)
            ob = len(prompt) - 1
            n = ob + len(sampled)
            adv = np.zeros(n, dtype=np.float32)
            adv[ob:] = ADVANTAGES[(i * 2 + j) % len(ADVANTAGES)]
            mask = np.zeros(n, dtype=np.float32)
            mask[ob:] = 1.0
            rec = np.zeros(n, dtype=np.float32)
            rec[ob:] = np.asarray(s.logprobs, dtype=np.float32)
            hi = np.where(np.arange(n) % 2 == 0, 0.5, 4.0).astype(np.float32)  # half the tokens truncated
            inputs = {
                "target_tokens": np.asarray(prompt[1:] + sampled, dtype=np.int64),
                "advantages": adv,
                "logprobs": rec + 0.5 * mask,
                "clip_high_threshold": hi,
                "recorded_logprobs": rec,
                "recorded_mask": mask,
                "provenance": (
                    [types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(sampled) - 1)],
                    [types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=len(prompt) - 1),
                     types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(sampled))],
                ),
            }
            out.append((np.asarray(prompt + sampled[:-1], dtype=np.int64), inputs))
    return out


def reference(base_dir: str, init_dir: str, data, loss_fn: str, config, clip: float, eps: float):
    model = PeftModel.from_pretrained(load_base(base_dir), init_dir, is_trainable=True)
    model.eval()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert named and all(".lora_A." in n or ".lora_B." in n for n, _ in named), [n for n, _ in named][:5]
    params = [p for _, p in named]

    lps, losses = [], []
    for tokens, inputs in data:
        lp = target_logprobs(model, tokens, inputs["target_tokens"])
        extra = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items() if k not in ("target_tokens", "provenance")}
        losses.append(ref_loss(loss_fn, config, lp, extra))
        lps.append(lp.detach().numpy().copy())
    loss = torch.stack(losses).sum()
    loss.backward()
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None)))
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    max_grad = max(float(p.grad.abs().max()) for p in params if p.grad is not None)
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=eps, weight_decay=WEIGHT_DECAY)
    opt.step()
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}
    return lps, float(loss.detach()), grad_norm, max_grad, state


def ratio_stats(kind: str, loss_fn: str, config, lps, data) -> dict:
    """How the ratio-based losses are exercised: max ratio, and tokens where PPO/CISPO clip is active."""
    if kind not in ("rl", "rl_clip_tokens"):
        return {}
    r = np.concatenate([np.exp(lp.astype(np.float64) - inp["logprobs"]) for lp, (_, inp) in zip(lps, data)])
    a = np.concatenate([inp["advantages"] for _, inp in data])
    stats_loss = loss_fn if loss_fn in CLIP_DEFAULTS else "ppo"  # IS and DRO: counted against PPO's range
    los, his = zip(*(thresholds(stats_loss, config, {k: torch.tensor(v) for k, v in inp.items() if k.startswith("clip")},
                                torch.tensor(lp)) for lp, (_, inp) in zip(lps, data)))
    lo, hi = torch.cat(los).numpy(), torch.cat(his).numpy()
    # PPO's min picks the clipped (constant) term where A > 0 and r > hi, or A < 0 and r < lo.
    ppo_clipped = int(((a > 0) & (r > hi)).sum() + ((a < 0) & (r < lo)).sum())
    outside = int(((r < lo) | (r > hi)).sum())
    return {"max_ratio": float(r.max()), "min_ratio": float(r.min()), "n_ratio_gt_2": int((r > 2).sum()),
            "ppo_clipped_tokens": ppo_clipped, "tokens_outside_clip": outside, "n_tokens": int(r.size),
            "n_pos_adv": int((a > 0).sum()), "n_neg_adv": int((a < 0).sum())}


def main() -> None:
    alias, base_dir, storage = sys.argv[1], sys.argv[2], sys.argv[3]
    service = tinker.ServiceClient()
    rng = np.random.default_rng(20240611)
    seqs = [rng.integers(3, 1000, size=n + 1) for n in LENGTHS]

    # Base-model logprobs of the next tokens: a fresh adapter (B = 0) gives exactly these.
    base = load_base(base_dir)
    with torch.no_grad():
        base_lp = [target_logprobs(base, s[:-1], s[1:]).numpy().copy() for s in seqs]
    del base

    results: dict[str, dict] = {}
    for name, loss_fn, config, kind, clip, eps in CASES:
        tc = service.create_lora_training_client(base_model=alias, rank=RANK, seed=SEED).result()
        data = stable_data(tc, name, seqs) if kind == "stable" else make_data(kind, rng, base_lp, seqs)
        tc.save_weights_for_sampler(f"init-{name}").result()
        init_dir = adapter_dir(storage, tc.model_id, f"init-{name}")

        fb = tc.forward_backward([to_datum(t, inp) for t, inp in data], loss_fn, config).result()
        adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=eps,
                                weight_decay=WEIGHT_DECAY, grad_clip_norm=clip)
        opt = tc.optim_step(adam).result()
        tc.save_weights_for_sampler(f"after-{name}").result()
        after_dir = adapter_dir(storage, tc.model_id, f"after-{name}")

        ref_lps, ref_loss_sum, ref_norm, ref_max_grad, ref_state = reference(base_dir, init_dir, data, loss_fn, config, clip, eps)

        # logprobs: one output per datum, shaped like its target_tokens.
        max_lp_diff = 0.0
        shapes_ok = len(fb.loss_fn_outputs) == len(data)
        for out, ref_lp, (_, inp) in zip(fb.loss_fn_outputs, ref_lps, data):
            server_lp = np.asarray(out["logprobs"].to_numpy(), dtype=np.float64)
            if server_lp.size != ref_lp.size:
                shapes_ok = False
                max_lp_diff = math.inf
                continue
            shapes_ok = shapes_ok and list(server_lp.reshape(inp["target_tokens"].shape).shape) == list(ref_lp.shape)
            max_lp_diff = max(max_lp_diff, float(np.abs(server_lp.reshape(ref_lp.shape) - ref_lp).max()))

        init = load_file(os.path.join(init_dir, "adapter_model.safetensors"))
        after = load_file(os.path.join(after_dir, "adapter_model.safetensors"))
        keys_equal = set(after) == set(ref_state) == set(init)
        common = sorted(set(after) & set(ref_state))
        max_param_diff = max((float((after[k].float() - ref_state[k].float()).abs().max()) for k in common), default=math.inf)
        max_update = max((float((after[k].float() - init[k].float()).abs().max()) for k in common if k in init), default=0.0)
        server_norm = float((opt.metrics or {}).get("grad_norm", math.nan))

        results[name] = {
            "model_id": tc.model_id,
            "loss_fn": loss_fn,
            "max_logprob_diff": max_lp_diff,
            "logprob_shapes_ok": shapes_ok,
            "loss_server": float(fb.metrics["loss:sum"]),
            "loss_ref": ref_loss_sum,
            "grad_norm_server": server_norm,
            "grad_norm_ref": ref_norm,
            "grad_clip_norm": clip,
            "adam_eps": eps,
            "max_abs_grad_after_clip": ref_max_grad,
            "max_param_diff": max_param_diff,
            "n_params_compared": len(common),
            "keys_equal": keys_equal,
            "max_update": max_update,
            **ratio_stats(kind, loss_fn, config, ref_lps, data),
        }
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)

    print(json.dumps(results))


if __name__ == "__main__":
    main()
