"""``sample``: token generation with a KV cache, plus prompt logprobs.

The prompt is prefilled once (batch 1) and its cache repeated for the ``num_samples`` sequences,
which then decode together; finished sequences leave the batch. Token choice happens on the CPU
in float32 with one ``torch.Generator`` per request (seeded from ``seed``, random without one),
so the same seed gives the same tokens on any device for the same logits.

Per-token logprob = log of the probability of the chosen token in the distribution actually
sampled from: logits / temperature, then top-k, then top-p (nucleus), renormalised. At
temperature 0 the choice is the argmax and its logprob comes from the temperature-1 distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import UserError
from .models import BaseModel, Registry
from .prompt_scores import alt_tokens, parse_targets, score_targets
from .params import (check_token_ids, get_bool, get_float, get_int, get_int_list, get_obj, get_opt_int,
                     get_opt_str, get_str, get_str_list)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1  # <= 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: frozenset[int] = field(default_factory=frozenset)
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True  # false: the tokenizer's EOS does not end a sequence

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> SamplingParams:
        w = "sampling_params"
        params = cls(
            max_tokens=get_int(obj, "max_tokens", w, minimum=1),
            temperature=get_float(obj, "temperature", w, default=1.0),
            top_k=get_int(obj, "top_k", w, default=-1, minimum=-1),
            top_p=get_float(obj, "top_p", w, default=1.0),
            seed=get_opt_int(obj, "seed", w),
            stop_tokens=frozenset(get_int_list(obj, "stop_tokens", w, default=[])),
            stop_strings=tuple(get_str_list(obj, "stop_strings", w, default=[])),
            stop_at_eos=get_bool(obj, "stop_at_eos", w, default=True),
        )
        if params.temperature < 0:
            raise UserError(f"sampling_params.temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise UserError(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
        if any(s == "" for s in params.stop_strings):
            raise UserError("sampling_params.stop_strings must not contain an empty string")
        return params


def sampling_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities (B, V) of the distribution sampled from at ``temperature`` > 0."""
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def choose_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token (B,) and its logprob (B,) for each row of ``logits`` (B, V), on the CPU."""
    tokens, chosen, _ = choose_tokens_and_dist(logits, params, generator)
    return tokens, chosen


def choose_tokens_and_dist(logits: torch.Tensor, params: SamplingParams,
                           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``choose_tokens``, plus the (B, V) log-distribution the logprobs come from."""
    logits = logits.float().cpu()
    if params.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = sampling_distribution(logits, params.temperature, params.top_k, params.top_p)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logp


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    # topk_sample_logprobs: per generated token, the top-K [id, logprob] of the distribution it
    # was drawn from (the same distribution as its logprob); None when not requested.
    topk: list[list[list[Any]]] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"tokens": self.tokens, "logprobs": self.logprobs, "stop_reason": self.stop_reason or "length"}
        if self.topk is not None:
            out["topk_logprobs"] = self.topk
        return out


def _stops(seq: Sequence, token: int, params: SamplingParams, base: BaseModel) -> bool:
    if token in params.stop_tokens or (params.stop_at_eos and token == base.eos_token_id):
        return True
    if params.stop_strings:
        text = base.tokenizer.decode(seq.tokens, skip_special_tokens=False)
        return any(s in text for s in params.stop_strings)
    return False


def generate(base: BaseModel, prompt: list[int], num_samples: int, params: SamplingParams,
             keep_prompt_logits: bool, topk_sample: int = 0) -> tuple[list[Sequence], torch.Tensor | None]:
    """Sample ``num_samples`` continuations of ``prompt`` with the currently active adapter.

    Returns the sequences and, with ``keep_prompt_logits``, the prompt's logits (P, V) float32.
    """
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    device = base.device
    seqs = [Sequence(topk=[] if topk_sample > 0 else None) for _ in range(num_samples)]
    with torch.inference_mode():
        out = base.hf(input_ids=torch.tensor([prompt], device=device), use_cache=True,
                      logits_to_keep=0 if keep_prompt_logits else 1)
        prompt_logits = out.logits[0].float() if keep_prompt_logits else None
        cache = out.cache
        if num_samples > 1:
            cache.batch_repeat_interleave(num_samples)
        next_logits = out.logits[:, -1].expand(num_samples, -1)
        active = list(range(num_samples))  # batch row -> sequence index
        for step in range(params.max_tokens):
            tokens, logprobs, dist = choose_tokens_and_dist(next_logits, params, generator)
            tops = dist.topk(min(topk_sample, dist.shape[-1]), dim=-1) if topk_sample > 0 else None
            still: list[int] = []
            for row, idx in enumerate(active):
                seq, tok = seqs[idx], int(tokens[row])
                seq.tokens.append(tok)
                seq.logprobs.append(float(logprobs[row]))
                if tops is not None and seq.topk is not None:
                    seq.topk.append([[i, v] for i, v in zip(tops.indices[row].tolist(), tops.values[row].tolist())])
                if _stops(seq, tok, params, base):
                    seq.stop_reason = "stop"
                else:
                    still.append(row)
            if not still or step + 1 == params.max_tokens:
                break
            if len(still) < len(active):
                cache.batch_select_indices(torch.tensor(still, device=device))
                active = [active[row] for row in still]
            feed = torch.tensor([[seqs[idx].tokens[-1]] for idx in active], device=device)
            out = base.hf(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            next_logits = out.logits[:, -1]
    return seqs, prompt_logits


def prompt_logprob_lists(prompt: list[int], logits: torch.Tensor, topk: int) -> tuple[list[Any], list[Any] | None]:
    """Entry i: log p(prompt[i] | prompt[:i]) and the top-``topk`` [id, logprob] pairs (entry 0: null)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1).cpu()
    targets = torch.tensor(prompt[1:], dtype=torch.int64)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
    lps: list[Any] = [None, *chosen]
    if topk <= 0:
        return lps, None
    values, ids = logp.topk(min(topk, logp.shape[-1]), dim=-1)
    tops: list[Any] = [None]
    for row_ids, row_vals in zip(ids.tolist(), values.tolist()):
        tops.append([[i, v] for i, v in zip(row_ids, row_vals)])
    return lps, tops


def sample(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    base = registry.base(get_str(args, "base_model"))
    adapter_dir = get_opt_str(args, "adapter_dir")
    prompt = get_int_list(args, "prompt")
    if not prompt:
        raise UserError("prompt must contain at least one token")
    check_token_ids(prompt, base.input_vocab_size, "prompt")
    num_samples = get_int(args, "num_samples", default=1, minimum=1)
    params = SamplingParams.parse(get_obj(args, "sampling_params"))
    want_prompt_logprobs = get_bool(args, "prompt_logprobs", default=False)
    topk = get_int(args, "topk_prompt_logprobs", default=0, minimum=0)
    topk_sample = get_int(args, "topk_sample_logprobs", default=0, minimum=0)
    limit = base.max_context_length
    if limit and len(prompt) + params.max_tokens > limit:
        raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                        f"model's context length {limit}")

    targets = parse_targets(args, len(prompt), base.vocab_size)
    alt_k = get_int(args, "prompt_alt_tokens_k", default=0, minimum=0)
    if alt_k > 0 and len(prompt) < 2:
        raise UserError("prompt_alt_tokens_k needs a prompt of at least 2 tokens")

    adapter = registry.sampler_adapter(base, adapter_dir) if adapter_dir is not None else None
    base.activate(adapter, trainable=False)
    keep = want_prompt_logprobs or topk > 0 or targets is not None or alt_k > 0
    seqs, prompt_logits = generate(base, prompt, num_samples, params, keep_prompt_logits=keep, topk_sample=topk_sample)
    lps: list[Any] | None = None
    tops: list[Any] | None = None
    if prompt_logits is not None and (want_prompt_logprobs or topk > 0):
        all_lps, tops = prompt_logprob_lists(prompt, prompt_logits, topk)
        lps = all_lps if want_prompt_logprobs else None
    out: dict[str, Any] = {
        "sequences": [s.to_json() for s in seqs],
        "prompt_logprobs": lps,
        "topk_prompt_logprobs": tops,
    }
    if targets is not None and prompt_logits is not None:
        out["target_prompt_logprobs"] = score_targets(prompt_logits, targets)
    if alt_k > 0 and prompt_logits is not None:
        out["prompt_alt_tokens"] = alt_tokens(prompt_logits, alt_k, params.temperature, params.seed)
    return out
