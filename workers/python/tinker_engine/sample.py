"""``sample`` and ``sample_batch``: batched token generation with a KV cache, plus prompt logprobs.

A batch holds any number of sample requests over one base model. Each request's prompt is
prefilled once (left-padded to the longest prompt, with an attention mask and explicit position
ids) and its cache rows are repeated for its ``num_samples`` sequences; all sequences then decode
together, one forward per token; finished sequences leave the batch. Requests for different
adapters (sampler versions) share the batch through PEFT's per-row ``adapter_names`` when more
than one adapter is involved.

Token choice runs on the model's device, for all rows at once. Randomness is per request: its
``seed`` (random without one) seeds a CPU ``torch.Generator`` that draws one uniform number per
sequence and step up front; a token is chosen by inverse-CDF lookup of that number in the row's
distribution (vocabulary order). So the same seed gives the same tokens for the same logits
whatever else shares the batch and on any device.

Per-token logprob = log of the probability of the chosen token in the distribution actually
sampled from: logits / temperature, then top-k, then top-p (nucleus), renormalised. At
temperature 0 the choice is the argmax and its logprob comes from the temperature-1 distribution.

Generation is a Python generator that yields between decode steps, so the engine's request loop
can run other operations (training) in between (server.py).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from .errors import UserError
from .models import BaseModel, Registry
from .params import (check_token_ids, get_bool, get_float, get_int, get_int_list, get_obj, get_opt_int,
                     get_opt_str, get_str, get_str_list)

# Positions of prompt logits turned into log-softmax at a time (bounds a float32 (chunk, V) buffer).
PROMPT_LOGPROB_CHUNK = 512


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


def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled`` (B, V) float32 with the tokens outside each row's top-k, then top-p, set to -inf.

    ``top_k`` (B,) int64 (<= 0 or >= V: off) and ``top_p`` (B,) float32 (1: off). Top-k keeps
    every token tied with the k-th largest; top-p keeps the smallest prefix (by probability after
    top-k) whose mass before it is < top_p, and always the most likely token.
    """
    vocab = scaled.shape[-1]
    sorted_vals, order = scaled.sort(dim=-1, descending=True, stable=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth = sorted_vals.gather(-1, (k - 1).unsqueeze(-1))
    drop = scaled < kth
    if bool((top_p < 1.0).any()):
        sorted_probs = torch.softmax(sorted_vals.masked_fill(sorted_vals < kth, float("-inf")), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p.unsqueeze(-1)
        drop_sorted[:, 0] = False  # the most likely token always stays
        drop |= torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def sampling_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities (B, V) of the distribution sampled from at ``temperature`` > 0."""
    scaled = logits.float() / temperature
    rows = scaled.shape[0]
    if 0 < top_k < scaled.shape[-1] or top_p < 1.0:
        scaled = filter_logits(scaled, torch.full((rows,), top_k, dtype=torch.int64, device=scaled.device),
                               torch.full((rows,), top_p, dtype=torch.float32, device=scaled.device))
    return torch.log_softmax(scaled, dim=-1)


@dataclass
class RowParams:
    """Per-row sampling settings as device tensors (rows = sequences of the batch)."""

    temperature: torch.Tensor  # (B, 1) float32; 1 for greedy rows
    greedy: torch.Tensor  # (B,) bool
    top_k: torch.Tensor  # (B,) int64; 0 for greedy rows
    top_p: torch.Tensor  # (B,) float32; 1 for greedy rows
    uniforms: torch.Tensor  # (B, max steps) float32 in [0, 1)
    any_filter: bool
    any_greedy: bool
    all_greedy: bool

    def select(self, keep: torch.Tensor) -> RowParams:
        return RowParams(self.temperature[keep], self.greedy[keep], self.top_k[keep], self.top_p[keep],
                         self.uniforms[keep], self.any_filter, self.any_greedy, self.all_greedy)


def choose_tokens(logits: torch.Tensor, rows: RowParams, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token (B,) and its logprob (B,) for each row of ``logits`` (B, V), on their device."""
    logits = logits.float()
    if rows.all_greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    scaled = logits / rows.temperature
    if rows.any_filter:
        scaled = filter_logits(scaled, rows.top_k, rows.top_p)
    logp = torch.log_softmax(scaled, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    # (1 - u) in (0, 1]: the first index whose cumulative mass reaches it has non-zero probability.
    target = (1.0 - rows.uniforms[:, step : step + 1]) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    if rows.any_greedy:
        tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "stop_reason": self.stop_reason or "length"}


@dataclass
class SampleRequest:
    """One validated sample request of a batch."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    adapter_dir: str | None
    want_prompt_logprobs: bool
    topk: int
    adapter: str | None = None  # the loaded PEFT adapter name, None: the base model alone
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    topk_prompt_logprobs: list[Any] | None = None

    @classmethod
    def parse(cls, base: BaseModel, args: dict[str, Any]) -> SampleRequest:
        prompt = get_int_list(args, "prompt")
        if not prompt:
            raise UserError("prompt must contain at least one token")
        check_token_ids(prompt, base.input_vocab_size, "prompt")
        req = cls(
            prompt=prompt,
            num_samples=get_int(args, "num_samples", default=1, minimum=1),
            params=SamplingParams.parse(get_obj(args, "sampling_params")),
            adapter_dir=get_opt_str(args, "adapter_dir"),
            want_prompt_logprobs=get_bool(args, "prompt_logprobs", default=False),
            topk=get_int(args, "topk_prompt_logprobs", default=0, minimum=0),
        )
        limit = base.max_context_length
        if limit and len(prompt) + req.params.max_tokens > limit:
            raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({req.params.max_tokens}) exceeds the "
                            f"model's context length {limit}")
        return req

    def result(self) -> dict[str, Any]:
        return {
            "sequences": [s.to_json() for s in self.sequences],
            "prompt_logprobs": self.prompt_logprobs if self.want_prompt_logprobs else None,
            "topk_prompt_logprobs": self.topk_prompt_logprobs,
        }


def _stops(seq: Sequence, token: int, params: SamplingParams, base: BaseModel, stop_window: int) -> bool:
    if token in params.stop_tokens or (params.stop_at_eos and token == base.eos_token_id):
        return True
    if params.stop_strings:
        # A stop string first appears at the end of the text: decoding the last few tokens suffices.
        text = base.tokenizer.decode(seq.tokens[-stop_window:], skip_special_tokens=False)
        return any(s in text for s in params.stop_strings)
    return False


def prompt_logprob_lists(prompt: list[int], logits: torch.Tensor, topk: int) -> tuple[list[Any], list[Any] | None]:
    """Entry i: log p(prompt[i] | prompt[:i]) and the top-``topk`` [id, logprob] pairs (entry 0: null).

    ``logits`` (P, V) in any float dtype, on any device; log-softmax runs in float32 chunks.
    """
    lps: list[Any] = [None]
    tops: list[Any] | None = [None] if topk > 0 else None
    targets = torch.tensor(prompt[1:], dtype=torch.int64, device=logits.device)
    for start in range(0, len(prompt) - 1, PROMPT_LOGPROB_CHUNK):
        end = min(start + PROMPT_LOGPROB_CHUNK, len(prompt) - 1)
        logp = torch.log_softmax(logits[start:end].float(), dim=-1)
        lps.extend(logp.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1).cpu().tolist())
        if tops is not None:
            values, ids = logp.topk(min(topk, logp.shape[-1]), dim=-1)
            for row_ids, row_vals in zip(ids.cpu().tolist(), values.cpu().tolist()):
                tops.append([[i, v] for i, v in zip(row_ids, row_vals)])
    return lps, tops


class Batch:
    """The model state of one generating batch: which adapter(s) its forwards use."""

    def __init__(self, base: BaseModel, adapters: list[str | None]) -> None:
        self.base = base
        distinct = set(adapters)
        self.mixed = len(distinct) > 1
        self.single = next(iter(distinct)) if not self.mixed else None
        self.enable = next((a for a in adapters if a is not None), None)
        self.row_names = ["__base__" if a is None else a for a in adapters]

    def forward(self, rows: list[int] | None, **kwargs: Any) -> Any:
        """One forward of the batch (``rows``: which of the batch's rows are present, None: all)."""
        if not self.mixed:
            self.base.activate(self.single, trainable=False)
            return self.base.hf(**kwargs)
        self.base.activate(self.enable, trainable=False)  # adapter layers on; rows pick their adapter
        assert self.base.peft is not None
        names = self.row_names if rows is None else [self.row_names[r] for r in rows]
        return self.base.peft(adapter_names=names, **kwargs)


def _compute_prompt_logprobs(base: BaseModel, req: SampleRequest) -> None:
    batch = Batch(base, [req.adapter])
    with torch.inference_mode():
        out = batch.forward(None, input_ids=torch.tensor([req.prompt], device=base.device), use_cache=False)
        lps, tops = prompt_logprob_lists(req.prompt, out.logits[0], req.topk)
    req.prompt_logprobs = lps
    req.topk_prompt_logprobs = tops


def generate(base: BaseModel, reqs: list[SampleRequest]) -> Iterator[None]:
    """Fill every request's ``sequences`` (and prompt logprobs); yields between decode steps."""
    device = base.device
    for req in reqs:
        if req.want_prompt_logprobs or req.topk > 0:
            _compute_prompt_logprobs(base, req)
            yield
    n_req = len(reqs)
    longest = max(len(r.prompt) for r in reqs)
    ids = torch.zeros((n_req, longest), dtype=torch.int64)
    mask = torch.zeros((n_req, longest), dtype=torch.int64)
    for i, r in enumerate(reqs):
        ids[i, longest - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.int64)
        mask[i, longest - len(r.prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)

    # Sequence rows: request index, params, seeded uniforms.
    row_req: list[int] = []
    uniforms: list[torch.Tensor] = []
    steps = max(r.params.max_tokens for r in reqs)
    for i, r in enumerate(reqs):
        gen = torch.Generator(device="cpu")
        if r.params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(r.params.seed)
        u = torch.rand((r.num_samples, r.params.max_tokens), generator=gen, dtype=torch.float32)
        uniforms.append(torch.nn.functional.pad(u, (0, steps - r.params.max_tokens)))
        row_req.extend([i] * r.num_samples)
        r.sequences = [Sequence() for _ in range(r.num_samples)]
    seqs = [s for r in reqs for s in r.sequences]
    greedy = [reqs[i].params.temperature == 0.0 for i in row_req]
    vocab = base.vocab_size
    top_k = [0 if g else reqs[i].params.top_k for i, g in zip(row_req, greedy)]
    top_p = [1.0 if g else reqs[i].params.top_p for i, g in zip(row_req, greedy)]
    rows = RowParams(
        temperature=torch.tensor([[1.0 if g else reqs[i].params.temperature] for i, g in zip(row_req, greedy)],
                                 dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        uniforms=torch.cat(uniforms).to(device),
        any_filter=any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p),
        any_greedy=any(greedy),
        all_greedy=all(greedy),
    )
    windows = [max((len(s) for s in reqs[i].params.stop_strings), default=0) + 8 for i in row_req]
    batch = Batch(base, [reqs[i].adapter for i in row_req])

    # Prefill each distinct prompt once, then repeat its cache rows for its samples. The model
    # fills the cache object in place (transformers names the argument ``cache`` from 5.2x on,
    # ``past_key_values`` before: BaseModel.cache_kwarg).
    cache = DynamicCache(config=base.hf.config)
    with torch.inference_mode():
        out = batch.forward(_req_rows(reqs), input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=positions.to(device), use_cache=True, logits_to_keep=1,
                            **{base.cache_kwarg: cache})
        index = torch.tensor(row_req, device=device)
        if len(row_req) != n_req:
            cache.batch_select_indices(index)
        logits = out.logits[:, -1][index]
        attn = mask.to(device)[index]
        pos = positions[:, -1].to(device)[index]
        del out
    active = list(range(len(seqs)))  # batch row -> sequence index
    for step in range(steps):
        with torch.inference_mode():
            tokens, logprobs = choose_tokens(logits, rows, step)
            host = torch.stack([tokens.double(), logprobs.double()], dim=-1).cpu().tolist()
        still: list[int] = []
        for row, idx in enumerate(active):
            seq, (tok_f, lp) = seqs[idx], host[row]
            tok = int(tok_f)
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            params = reqs[row_req[idx]].params
            if _stops(seq, tok, params, base, windows[idx]):
                seq.stop_reason = "stop"
            elif len(seq.tokens) < params.max_tokens:
                still.append(row)
        if not still:
            break
        yield
        with torch.inference_mode():
            if len(still) < len(active):
                keep = torch.tensor(still, device=device)
                cache.batch_select_indices(keep)
                tokens, attn, pos = tokens[keep], attn[keep], pos[keep]
                rows = rows.select(keep)
                active = [active[row] for row in still]
            pos = pos + 1
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
            out = batch.forward(active, input_ids=tokens.unsqueeze(-1), attention_mask=attn,
                                position_ids=pos.unsqueeze(-1), use_cache=True, logits_to_keep=1,
                                **{base.cache_kwarg: cache})
            logits = out.logits[:, -1]
            del out


def _req_rows(reqs: list[SampleRequest]) -> list[int]:
    """For the prefill (one row per request): the first sequence row of each request."""
    rows: list[int] = []
    at = 0
    for r in reqs:
        rows.append(at)
        at += r.num_samples
    return rows


def parse_batch(registry: Registry, args: dict[str, Any]) -> tuple[BaseModel, list[SampleRequest | UserError]]:
    """The batch's base model and each request, validated on its own (a bad one becomes its error)."""
    base = registry.base(get_str(args, "base_model"))
    raw = args.get("requests")
    if not isinstance(raw, list) or not raw:
        raise UserError("requests must be a non-empty list of sample requests")
    parsed: list[SampleRequest | UserError] = []
    for i, item in enumerate(raw):
        try:
            if not isinstance(item, dict):
                raise UserError(f"request {i} must be an object")
            parsed.append(SampleRequest.parse(base, item))
        except UserError as exc:
            parsed.append(exc)
    return base, parsed


def run_batch(registry: Registry, base: BaseModel,
              parsed: list[SampleRequest | UserError]) -> Generator[None, None, list[dict[str, Any]]]:
    """Generate every valid request together; each entry of the result is its own reply."""
    reqs: list[SampleRequest] = []
    pinned: list[str] = []
    try:
        for i, item in enumerate(parsed):
            if isinstance(item, SampleRequest) and item.adapter_dir is not None:
                try:
                    item.adapter = registry.sampler_adapter(base, item.adapter_dir)
                    registry.pin(item.adapter)
                    pinned.append(item.adapter)
                except UserError as exc:
                    parsed[i] = exc
        reqs = [r for r in parsed if isinstance(r, SampleRequest)]
        if reqs:
            yield from generate(base, reqs)
    finally:
        for adapter in pinned:
            registry.unpin(adapter)
    return [
        {"ok": False, "error": {"category": "user", "message": str(item)}} if isinstance(item, UserError)
        else {"ok": True, "result": item.result()}
        for item in parsed
    ]


def sample_batch_steps(registry: Registry, args: dict[str, Any]) -> Generator[None, None, dict[str, Any]]:
    base, parsed = parse_batch(registry, args)

    def steps() -> Generator[None, None, dict[str, Any]]:
        results = yield from run_batch(registry, base, parsed)
        return {"results": results}

    return steps()


def sample_steps(registry: Registry, args: dict[str, Any]) -> Generator[None, None, dict[str, Any]]:
    """The single-request ``sample`` op: its user error is the op's error."""
    base = registry.base(get_str(args, "base_model"))
    parsed: list[SampleRequest | UserError] = [SampleRequest.parse(base, args)]

    def steps() -> Generator[None, None, dict[str, Any]]:
        (entry,) = yield from run_batch(registry, base, parsed)
        if not entry["ok"]:
            raise UserError(entry["error"]["message"])
        return entry["result"]

    return steps()


def run_to_end(steps: Generator[None, None, dict[str, Any]]) -> dict[str, Any]:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def sample(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    return run_to_end(sample_steps(registry, args))


def sample_batch(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    return run_to_end(sample_batch_steps(registry, args))
