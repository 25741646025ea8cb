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

import logging
import traceback
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from . import kv_cache
from .errors import UserError
from .models import BaseModel, Registry
from .prompt_scores import alt_tokens, parse_targets, score_targets
from .params import check_token_ids, get_bool, get_int, get_int_list, get_obj, get_opt_str, get_str
from .protocol import defaults
from .settings import current as settings

log = logging.getLogger("tinker_engine")

# Positions of prompt logits turned into log-softmax at a time (bounds a float32 (chunk, V) buffer).
PROMPT_LOGPROB_CHUNK = 512


#: The sampling defaults (queues/contract/params.ts, read from protocol.json), for in-process callers.
SAMPLING_DEFAULTS = defaults("sample", "sampling_params")


@dataclass(frozen=True)
class SamplingParams:
    """A request's ``sampling_params``. Their fields, bounds and defaults are declared once, in
    queues/contract/params.ts. The engine checks every request's args against protocol.json before
    the op runs, so ``parse`` only converts; a field an in-process caller leaves out takes its default."""

    max_tokens: int
    temperature: float  # 0: greedy
    top_k: int  # <= 0: off
    top_p: float  # 1: off
    seed: int | None
    stop_tokens: frozenset[int]
    stop_strings: tuple[str, ...]
    stop_at_eos: bool  # false: the tokenizer's EOS does not end a sequence

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> SamplingParams:
        p = {**SAMPLING_DEFAULTS, **obj}
        return cls(max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]), top_k=int(p["top_k"]),
                   top_p=float(p["top_p"]), seed=None if p["seed"] is None else int(p["seed"]),
                   stop_tokens=frozenset(p["stop_tokens"]), stop_strings=tuple(p["stop_strings"]),
                   stop_at_eos=bool(p["stop_at_eos"]))


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

    def concat(self, other: RowParams) -> RowParams:
        width = max(self.uniforms.shape[1], other.uniforms.shape[1])
        pad = torch.nn.functional.pad
        return RowParams(
            torch.cat([self.temperature, other.temperature]), torch.cat([self.greedy, other.greedy]),
            torch.cat([self.top_k, other.top_k]), torch.cat([self.top_p, other.top_p]),
            torch.cat([pad(self.uniforms, (0, width - self.uniforms.shape[1])),
                       pad(other.uniforms, (0, width - other.uniforms.shape[1]))]),
            self.any_filter or other.any_filter, self.any_greedy or other.any_greedy,
            self.all_greedy and other.all_greedy)


def choose_tokens(logits: torch.Tensor, rows: RowParams,
                  ntok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next token (B,), its logprob (B,) and the (B, V) log-distribution it comes from, on the device."""
    logits = logits.float()
    if rows.all_greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logp
    scaled = logits / rows.temperature
    if rows.any_filter:
        scaled = filter_logits(scaled, rows.top_k, rows.top_p)
    logp = torch.log_softmax(scaled, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    # (1 - u) in (0, 1]: the first index whose cumulative mass reaches it has non-zero probability.
    # Each row's uniform for its next token (``ntok``: tokens it sampled so far).
    target = (1.0 - rows.uniforms.gather(-1, ntok.unsqueeze(-1))) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    if rows.any_greedy:
        tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
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
        out: dict[str, Any] = {"tokens": self.tokens, "logprobs": self.logprobs,
                               "stop_reason": self.stop_reason or "length"}
        if self.topk is not None:
            out["topk_logprobs"] = self.topk
        return out


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
    targets: torch.Tensor | None = None  # target_prompt_logprobs ids (prompt_scores.py)
    target_prompt_logprobs: dict[str, Any] | None = None
    topk_sample: int = 0  # topk_sample_logprobs
    alt_k: int = 0  # prompt_alt_tokens_k
    prompt_alt_tokens: Any = None
    rows_left: int = 0  # sequences still generating
    error: Exception | None = None  # the generation failed
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
        req.targets = parse_targets(args, len(prompt), base.vocab_size)
        req.topk_sample = get_int(args, "topk_sample_logprobs", default=0, minimum=0)
        req.alt_k = get_int(args, "prompt_alt_tokens_k", default=0, minimum=0)
        if req.alt_k > 0 and len(prompt) < 2:
            raise UserError("prompt_alt_tokens_k needs a prompt of at least 2 tokens")
        return req

    @property
    def needs_prompt_logits(self) -> bool:
        return self.want_prompt_logprobs or self.topk > 0 or self.targets is not None or self.alt_k > 0

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sequences": [s.to_json() for s in self.sequences],
            "prompt_logprobs": self.prompt_logprobs if self.want_prompt_logprobs else None,
            "topk_prompt_logprobs": self.topk_prompt_logprobs,
        }
        if self.target_prompt_logprobs is not None:
            out["target_prompt_logprobs"] = self.target_prompt_logprobs
        if self.prompt_alt_tokens is not None:
            out["prompt_alt_tokens"] = self.prompt_alt_tokens
        return out


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


def _forward(base: BaseModel, names: list[str | None], **kwargs: Any) -> Any:
    """One forward with each row's adapter (None: the base model alone).

    One adapter for all rows: activate it and run the module tree directly. Several: PEFT's
    mixed-batch LoRA forward (``adapter_names``, ``"__base__"`` for the base model).
    """
    distinct = set(names)
    if len(distinct) == 1:
        base.activate(next(iter(distinct)), trainable=False)
        return base.hf(**kwargs)
    base.activate(next(a for a in names if a is not None), trainable=False)  # adapter layers on
    assert base.peft is not None
    return base.peft(adapter_names=["__base__" if a is None else a for a in names], **kwargs)


def _compute_prompt_logprobs(base: BaseModel, req: SampleRequest) -> None:
    out = _forward(base, [req.adapter], input_ids=torch.tensor([req.prompt], device=base.device), use_cache=False)
    if req.want_prompt_logprobs or req.topk > 0:
        req.prompt_logprobs, req.topk_prompt_logprobs = prompt_logprob_lists(req.prompt, out.logits[0], req.topk)
    if req.targets is not None:
        req.target_prompt_logprobs = score_targets(out.logits[0], req.targets)
    if req.alt_k > 0:
        req.prompt_alt_tokens = alt_tokens(out.logits[0], req.alt_k, req.params.temperature, req.params.seed)


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge_caches(a: DynamicCache, b: DynamicCache) -> None:
    """Append ``b``'s rows to ``a``, left-padding the shorter sequence dimension with zeros."""
    for la, lb in zip(a.layers, b.layers):
        length = max(la.keys.shape[-2], lb.keys.shape[-2])
        la.keys = torch.cat([_left_pad(la.keys, length, -2), _left_pad(lb.keys, length, -2)])
        la.values = torch.cat([_left_pad(la.values, length, -2), _left_pad(lb.values, length, -2)])


class Generation:
    """The generating batch of one base model. Requests join between decode steps.

    Invariant between steps: every active row has its next-token ``logits``; the cache, the
    attention mask ``attn`` (rows x cached length, 0 on left padding) and the last position
    ``pos`` line up with the rows.
    """

    def __init__(self, base: BaseModel, max_tokens: int) -> None:
        self.base = base
        self.max_tokens = max_tokens
        self.waiting: list[SampleRequest] = []
        self._reset()

    def _reset(self) -> None:
        """No active rows (waiting requests stay)."""
        self.admitting: list[SampleRequest] = []
        self.row_seq: list[Sequence] = []
        self.row_req: list[SampleRequest] = []
        self.row_window: list[int] = []
        self.cache: DynamicCache | None = None
        self.attn = torch.zeros((0, 0), dtype=torch.int64)
        self.pos = torch.zeros((0,), dtype=torch.int64)
        self.logits = torch.zeros((0, 0))
        self.rows: RowParams | None = None
        self.ntok = torch.zeros((0,), dtype=torch.int64)  # tokens sampled so far per row

    @property
    def busy(self) -> bool:
        return bool(self.row_seq or self.waiting)

    def add(self, reqs: list[SampleRequest]) -> None:
        for r in reqs:
            r.sequences = [Sequence(topk=[] if r.topk_sample > 0 else None) for _ in range(r.num_samples)]
            r.rows_left = r.num_samples
        self.waiting.extend(reqs)

    def step(self) -> None:
        """One decode step of the active rows, then admit waiting requests that fit."""
        try:
            with torch.inference_mode():
                if self.row_seq:
                    self._decode()
                if self.waiting:
                    self._admit()
        except Exception as exc:
            for r in {id(r): r for r in self.row_req + self.admitting + self.waiting}.values():
                r.error = exc
            self.waiting = []
            self._reset()
            raise

    # --- decoding -------------------------------------------------------------------------------

    def _decode(self) -> None:
        assert self.rows is not None and self.cache is not None
        tokens, logprobs, dist = choose_tokens(self.logits, self.rows, self.ntok)
        host = torch.stack([tokens.double(), logprobs.double()], dim=-1).cpu().tolist()
        want_top = max(r.topk_sample for r in self.row_req)
        top_ids: list[list[int]] = []
        top_vals: list[list[float]] = []
        if want_top > 0:
            tops = dist.topk(min(want_top, dist.shape[-1]), dim=-1)
            top_ids, top_vals = tops.indices.cpu().tolist(), tops.values.cpu().tolist()
        still: list[int] = []
        for row, (tok_f, lp) in enumerate(host):
            seq, req, tok = self.row_seq[row], self.row_req[row], int(tok_f)
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if seq.topk is not None:
                k = req.topk_sample
                seq.topk.append([[i, v] for i, v in zip(top_ids[row][:k], top_vals[row][:k])])
            if _stops(seq, tok, req.params, self.base, self.row_window[row]):
                seq.stop_reason = "stop"
            elif len(seq.tokens) < req.params.max_tokens:
                still.append(row)
                continue
            req.rows_left -= 1
        if len(still) < len(host):
            if not still:
                self._reset()
                return
            self._select(still)
            tokens = tokens[torch.tensor(still, device=tokens.device)]
        self.pos = self.pos + 1
        self.ntok = self.ntok + 1
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=-1)
        out = _forward(self.base, [r.adapter for r in self.row_req], input_ids=tokens.unsqueeze(-1),
                       attention_mask=self.attn, position_ids=self.pos.unsqueeze(-1), use_cache=True,
                       logits_to_keep=1, **{self.base.cache_kwarg: self.cache})
        self.logits = out.logits[:, -1]

    def _select(self, keep_rows: list[int]) -> None:
        assert self.rows is not None and self.cache is not None
        keep = torch.tensor(keep_rows, device=self.base.device)
        self.cache.batch_select_indices(keep)
        self.attn, self.pos, self.logits, self.ntok = self.attn[keep], self.pos[keep], self.logits[keep], self.ntok[keep]
        self.rows = self.rows.select(keep)
        self.row_seq = [self.row_seq[i] for i in keep_rows]
        self.row_req = [self.row_req[i] for i in keep_rows]
        self.row_window = [self.row_window[i] for i in keep_rows]

    # --- admission ------------------------------------------------------------------------------

    def _padded_tokens(self, reqs: list[SampleRequest]) -> int:
        """Cache slots the batch would hold at its longest with ``reqs`` admitted (padding included)."""
        cached = self.attn.shape[1] if self.row_seq else 0
        longest = max([cached] + [len(r.prompt) for r in reqs])
        rest = [r.params.max_tokens - len(s.tokens) for s, r in zip(self.row_seq, self.row_req)]
        rest += [r.params.max_tokens for r in reqs]
        return (len(self.row_seq) + sum(r.num_samples for r in reqs)) * (longest + max(rest, default=0))

    def _admit(self) -> None:
        if self.row_seq and self.cache is not None and not kv_cache.plain_layers(self.cache):
            return  # joins need plain key/value layers; wait until the batch drains
        admit: list[SampleRequest] = []
        for r in self.waiting:
            if (admit or self.row_seq) and self._padded_tokens(admit + [r]) > self.max_tokens:
                break
            admit.append(r)
        if not admit:
            return
        self.waiting = self.waiting[len(admit):]
        self.admitting = admit
        base, device = self.base, self.base.device
        for r in admit:
            if r.needs_prompt_logits:
                _compute_prompt_logprobs(base, r)
        n_req = len(admit)
        longest = max(len(r.prompt) for r in admit)
        ids = torch.zeros((n_req, longest), dtype=torch.int64)
        mask = torch.zeros((n_req, longest), dtype=torch.int64)
        for i, r in enumerate(admit):
            ids[i, longest - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.int64)
            mask[i, longest - len(r.prompt):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = kv_cache.new_cache(base.hf.config)
        out = _forward(base, [r.adapter for r in admit], input_ids=ids.to(device), attention_mask=mask.to(device),
                       position_ids=positions.to(device), use_cache=True, logits_to_keep=1,
                       **{base.cache_kwarg: cache})
        row_of = [i for i, r in enumerate(admit) for _ in range(r.num_samples)]
        index = torch.tensor(row_of, device=device)
        if len(row_of) != n_req:
            cache.batch_select_indices(index)
        logits = out.logits[:, -1][index]
        attn = mask.to(device)[index]
        pos = positions[:, -1].to(device)[index]
        rows = _row_params(base, admit, device)
        seqs = [s for r in admit for s in r.sequences]
        reqs = [admit[i] for i in row_of]
        windows = [max((len(s) for s in r.params.stop_strings), default=0) + 8 for r in reqs]
        if not self.row_seq:
            self.cache, self.attn, self.pos, self.logits, self.rows = cache, attn, pos, logits, rows
            self.ntok = torch.zeros((len(seqs),), dtype=torch.int64, device=device)
            self.row_seq, self.row_req, self.row_window = seqs, reqs, windows
            self.admitting = []
            return
        assert self.cache is not None and self.rows is not None
        _merge_caches(self.cache, cache)
        length = max(self.attn.shape[1], attn.shape[1])
        self.attn = torch.cat([_left_pad(self.attn, length, 1), _left_pad(attn, length, 1)])
        self.pos = torch.cat([self.pos, pos])
        self.logits = torch.cat([self.logits, logits.to(self.logits.dtype)])
        self.ntok = torch.cat([self.ntok, torch.zeros((len(seqs),), dtype=torch.int64, device=device)])
        self.rows = self.rows.concat(rows)
        self.row_seq += seqs
        self.row_req += reqs
        self.row_window += windows
        self.admitting = []


def _row_params(base: BaseModel, reqs: list[SampleRequest], device: torch.device) -> RowParams:
    """Sampling settings of every sequence row of ``reqs``, with each request's seeded uniforms."""
    uniforms: list[torch.Tensor] = []
    greedy: list[bool] = []
    temperature: list[list[float]] = []
    top_k: list[int] = []
    top_p: list[float] = []
    width = max(r.params.max_tokens for r in reqs)
    for r in reqs:
        gen = torch.Generator(device="cpu")
        if r.params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(r.params.seed)
        u = torch.rand((r.num_samples, r.params.max_tokens), generator=gen, dtype=torch.float32)
        uniforms.append(torch.nn.functional.pad(u, (0, width - r.params.max_tokens)))
        g = r.params.temperature == 0.0
        greedy += [g] * r.num_samples
        temperature += [[1.0 if g else r.params.temperature]] * r.num_samples
        top_k += [0 if g else r.params.top_k] * r.num_samples
        top_p += [1.0 if g else r.params.top_p] * r.num_samples
    return RowParams(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        uniforms=torch.cat(uniforms).to(device),
        any_filter=any(0 < k < base.vocab_size for k in top_k) or any(p < 1.0 for p in top_p),
        any_greedy=any(greedy),
        all_greedy=all(greedy),
    )


def parse_requests(registry: Registry, args: dict[str, Any]) -> tuple[BaseModel, list[SampleRequest | UserError]]:
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


Steps = Generator[None, None, dict[str, Any]]


def base_on_cuda(base: BaseModel) -> bool:
    return base.device.type == "cuda"


class Sampler:
    """One ``Generation`` per base model; sample ops add their requests and wait for them.

    ``advance()`` runs one step of every busy generation; the request loop calls it between
    reading requests, and ``run_to_end`` calls it for in-process use.
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.generations: dict[str, Generation] = {}
        # Most cache slots (rows x padded length at its longest) one generating batch may hold;
        # requests beyond it wait for rows to finish.
        self.max_tokens = settings().sample_tokens

    @property
    def busy(self) -> bool:
        return any(g.busy for g in self.generations.values())

    def advance(self) -> None:
        for name, gen in list(self.generations.items()):
            if gen.busy and not gen.row_seq and self.registry.trained_since_release:
                # A batch starts after training: hand the training step's cached blocks back first.
                self.registry.trained_since_release = False
                if base_on_cuda(gen.base):
                    torch.cuda.empty_cache()
            if gen.busy:
                try:
                    gen.step()
                except Exception:  # noqa: BLE001 - its requests carry the error to their replies
                    log.error("sample batch over %s failed:\n%s", name, traceback.format_exc().rstrip())
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()

    def _wait(self, base: BaseModel, parsed: list[SampleRequest | UserError]) -> Generator[None, None, list[dict[str, Any]]]:
        pinned: list[str] = []
        try:
            for i, item in enumerate(parsed):
                if isinstance(item, SampleRequest) and item.adapter_dir is not None:
                    try:
                        item.adapter = self.registry.sampler_adapter(base, item.adapter_dir)
                        self.registry.pin(item.adapter)
                        pinned.append(item.adapter)
                    except UserError as exc:
                        parsed[i] = exc
            reqs = [r for r in parsed if isinstance(r, SampleRequest)]
            if reqs:
                gen = self.generations.get(base.name)
                if gen is None or gen.base is not base:
                    gen = self.generations[base.name] = Generation(base, self.max_tokens)
                gen.add(reqs)
                while any(r.rows_left > 0 and r.error is None for r in reqs):
                    yield
        finally:
            for adapter in pinned:
                self.registry.unpin(adapter)
        results: list[dict[str, Any]] = []
        for item in parsed:
            if isinstance(item, UserError):
                results.append({"ok": False, "error": {"category": "user", "message": str(item)}})
            elif item.error is not None:
                exc = item.error
                category = "user" if isinstance(exc, UserError) else "server"
                results.append({"ok": False, "error": {"category": category, "message": f"{type(exc).__name__}: {exc}"}})
            else:
                results.append({"ok": True, "result": item.result()})
        return results

    def sample_batch_steps(self, args: dict[str, Any]) -> Steps:
        base, parsed = parse_requests(self.registry, args)

        def steps() -> Steps:
            return {"results": (yield from self._wait(base, parsed))}

        return steps()

    def sample_steps(self, args: dict[str, Any]) -> Steps:
        """The single-request ``sample`` op: its error is the op's error."""
        base = self.registry.base(get_str(args, "base_model"))
        parsed: list[SampleRequest | UserError] = [SampleRequest.parse(base, args)]

        def steps() -> Steps:
            (entry,) = yield from self._wait(base, parsed)
            if not entry["ok"]:
                if entry["error"]["category"] == "user":
                    raise UserError(entry["error"]["message"])
                raise RuntimeError(entry["error"]["message"])
            return entry["result"]

        return steps()

    def run_to_end(self, steps: Steps) -> dict[str, Any]:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            self.advance()
