"""``target_prompt_logprobs`` of a ``sample`` request (SDK 0.38): the logprobs of chosen token ids
at each prompt position, from the same prompt logits as ``prompt_logprobs``.

The request's ``target_prompt_logprobs`` is ``{"k": K, "ids": [...]}``: a dense row-major
``[len(prompt) - 1, K]`` matrix of token ids, ``-1`` where nothing is requested. Cell ``[i, j]`` is
scored at prompt position ``i + 1`` (position 0 has no preceding context). The answer has the same
shape: the float32 logprob of each id, 0.0 where the request had ``-1``.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UserError
from .params import get_int, get_int_list, get_obj


def parse_targets(args: dict[str, Any], prompt_len: int, vocab_size: int) -> torch.Tensor | None:
    if args.get("target_prompt_logprobs") is None:
        return None
    obj = get_obj(args, "target_prompt_logprobs")
    k = get_int(obj, "k", "target_prompt_logprobs", minimum=1)
    ids = get_int_list(obj, "ids", "target_prompt_logprobs")
    rows = prompt_len - 1
    if rows < 1:
        raise UserError("target_prompt_logprobs needs a prompt of at least 2 tokens")
    if len(ids) != rows * k:
        raise UserError(f"target_prompt_logprobs has {len(ids)} ids; shape [{rows}, {k}] needs {rows * k}")
    t = torch.tensor(ids, dtype=torch.int64).reshape(rows, k)
    bad = (t < -1) | (t >= vocab_size)
    if bool(bad.any()):
        raise UserError(f"target_prompt_logprobs: token id {int(t[bad][0])} is outside the vocabulary [0, {vocab_size}) (-1 requests nothing)")
    return t


def score_targets(prompt_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``prompt_logits`` (P, V): row i predicts prompt token i + 1; rows 0..P-2 are used."""
    logp = torch.log_softmax(prompt_logits[:-1].float(), dim=-1).cpu()
    wanted = targets >= 0
    values = logp.gather(-1, targets.clamp(min=0))
    return torch.where(wanted, values, torch.zeros_like(values))


def alt_tokens(prompt_logits: torch.Tensor, k: int, temperature: float, seed: int | None) -> dict[str, torch.Tensor]:
    """``prompt_alt_tokens_k``: ``k`` independent draws, with replacement, from the next-token
    distribution at every prompt position after the first (rows 0..P-2 of ``prompt_logits``), at
    the request's temperature, with the logprob of each draw in the distribution it was drawn from
    (as a sampled token's logprob). Temperature 0 repeats the argmax, scored at temperature 1.
    Draws use their own generator (seeded from the request's seed + 1), so they leave the sampled
    sequences unchanged."""
    logits = prompt_logits[:-1].float().cpu()
    if temperature == 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logp.argmax(dim=-1, keepdim=True).expand(-1, k)
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        gen = torch.Generator(device="cpu")
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed + 1)
        tokens = torch.multinomial(logp.exp(), k, replacement=True, generator=gen)
    return {"tokens": tokens.contiguous(), "logprobs": logp.gather(-1, tokens)}
