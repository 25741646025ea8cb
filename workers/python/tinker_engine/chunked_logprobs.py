"""Target logprobs from the last hidden state, the output layer run a chunk of tokens at a time.

``head_target_logprobs(hidden, head, targets)`` equals ``target_logprobs(head(hidden), targets)``
(logprobs.py), but the (tokens x vocab) logits never exist at once: each chunk of ``chunk`` tokens
goes through the head (the model's output layer, with its LoRA when the adapter trains it) and the
float32 log-softmax, and only its gathered logprobs are kept. For the backward, each chunk is
recomputed (``torch.utils.checkpoint``), so the backward too holds one chunk's logits, their
gradient and one float32 softmax at a time. The price is one more head matmul per token (the
recomputation) and one more pass over each chunk's logits; a single chunk is not checkpointed (its
logits are within the bound anyway), so ``TB_ENGINE_HEAD_CHUNK_TOKENS`` at or above the micro-batch
budget keeps the whole logits and recomputes nothing. The recomputation cannot be avoided by
precomputing softmax-weighted sums in the forward while the output layer has a trainable LoRA: its
gradient needs the (vocab x tokens) logit gradient, which depends on the loss's upstream gradient.

Every loss of losses.py reads only the gathered logprobs (1-D targets, or the K entries of (N, K)
top-K targets), so no loss needs the full-vocabulary logprobs and there is no unchunked fallback
to keep: a chunk's log-softmax is over the full vocabulary, exactly as before.

Co-batching (cobatch.py) runs each adapter over its own tokens; when the head runs on a chunk,
``token_offset()`` says where the chunk starts in the micro-batch's token axis.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch
from torch.utils.checkpoint import checkpoint

from .logprobs import target_logprobs
from .settings import current as settings

Head = Callable[[torch.Tensor], torch.Tensor]

# Where the tokens the output layer is running on start in the micro-batch's flattened token axis.
_OFFSET: ContextVar[int] = ContextVar("head_token_offset", default=0)


def token_offset() -> int:
    """The first token (of the micro-batch's flattened token axis) of the tensor a layer is given now:
    0 for the whole micro-batch, a chunk's start while the output layer runs on that chunk."""
    return _OFFSET.get()


def _chunk_logprobs(head: Head, hidden: torch.Tensor, targets: torch.Tensor, offset: int) -> torch.Tensor:
    mark = _OFFSET.set(offset)
    try:
        logits = head(hidden)
    finally:
        _OFFSET.reset(mark)
    return target_logprobs(logits, targets)


def head_target_logprobs(hidden: torch.Tensor, head: Head, targets: torch.Tensor,
                         chunk: int | None = None, offset: int = 0) -> torch.Tensor:
    """log p(targets) (float32, shaped like ``targets``: (N,) or (N, K)) for ``hidden`` (N, H), whose
    first token is token ``offset`` of the micro-batch; ``chunk`` tokens at a time (default
    ``TB_ENGINE_HEAD_CHUNK_TOKENS``: 1024 tokens x 151,936 vocabulary is 0.3 GiB of bf16 logits and
    0.6 GiB of float32 softmax)."""
    chunk = settings().head_chunk_tokens if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    n = hidden.shape[0]
    if n <= chunk:
        return _chunk_logprobs(head, hidden, targets, offset)
    parts = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h, t = hidden[start:end], targets[start:end]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, head, h, t, offset + start, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t, offset + start))
    return torch.cat(parts)


def plain_linear_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its output layer applied to the last hidden state and nothing
    else (no logit scaling or soft-capping), so that the chunked path computes what its forward does."""
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            return False
    return model.get_output_embeddings() is not None
