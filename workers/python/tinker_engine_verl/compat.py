"""verl 0.9.1 adjusted in two places: its FSDP2 wrap against newer torch, and its log-probabilities of a
packed row without flash-attn.

1. The wrap, adjusted only where a probe shows it is needed:

verl's FSDP2 wrap (``verl.utils.fsdp_utils.apply_fsdp2``) swaps torch's ``FSDPModule`` for a subclass
that also derives from ``abc.ABC`` while it shards a module that is an ABC (PEFT's LoRA layers are:
``BaseTunerLayer`` is one). Under torch 2.13 the class fully_shard then builds from that subclass
cannot be assigned to the module ("__class__ assignment: 'FSDPLinear' object layout differs from
'Linear'"), so an untied model with a LoRA on ``lm_head`` (Tinker's ``train_unembed``, on by default)
fails in create_model. torch 2.13's own wrapper class assigns fine to such modules, so where the probe
fails, verl's swap is turned off (``maybe_patch_fsdp_module`` yields without swapping).

2. With padding removed (levers.py), verl's engine asks ``logprobs_from_logits`` for the log-probabilities
of a packed row's (tokens, vocab) logits. Without flash-attn's cross-entropy kernel it loops over the
first dimension in Python, which for a packed row is one log-softmax per token: thousands of small
kernels per micro-batch. ``RowLogprobs`` computes the same in chunks of tokens, in float32, keeping
only the logits and each token's log-sum-exp for the backward (the loop kept one log-softmax per token,
as large as the logits). Padded (3-D) logits, and any call where flash-attn's kernel is present, go to
verl's function as before.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from typing import Any, Iterator

import torch

_checked = False
#: Elements of float32 logits one chunk of ``RowLogprobs`` holds (256 MiB).
CHUNK_ELEMENTS = 1 << 26


class RowLogprobs(torch.autograd.Function):
    """``log_softmax(logits)[t, labels[t]]`` for every token t of (T, V) ``logits``, in float32, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for s in range(0, logits.shape[0], rows):
            chunk = logits[s:s + rows].float()
            lse[s:s + rows] = torch.logsumexp(chunk, dim=-1)
            out[s:s + rows] = chunk.gather(1, labels[s:s + rows, None]).squeeze(1) - lse[s:s + rows]
        ctx.save_for_backward(logits, labels, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
        out = torch.empty_like(logits)
        grad = grad.float()
        for s in range(0, logits.shape[0], rows):
            g = grad[s:s + rows, None]
            # d/dlogits of (logit[label] - lse) = onehot(label) - softmax
            chunk = (logits[s:s + rows].float() - lse[s:s + rows, None]).exp_().mul_(-g)
            chunk.scatter_add_(1, labels[s:s + rows, None], g)
            out[s:s + rows] = chunk
        return out, None


def _verl_swap_breaks() -> bool:
    """Builds the class fully_shard would build for an ABC ``nn.Linear`` under verl's swap and assigns it."""
    import torch.nn as nn
    from verl.utils import fsdp_utils

    class _AbcLinear(nn.Linear, abc.ABC):
        pass

    module = _AbcLinear(1, 1)
    with fsdp_utils.maybe_patch_fsdp_module(module):
        wrapper = fsdp_utils.fully_shard_module.FSDPModule
    try:
        module.__class__ = type(f"FSDP{_AbcLinear.__name__}", (wrapper, _AbcLinear), {})
    except TypeError:
        return True
    return False


def apply() -> None:
    """Turns verl's ABC swap off where it breaks fully_shard (once per process)."""
    global _checked
    if _checked:
        return
    _checked = True
    _packed_logprobs()
    from verl.utils import fsdp_utils

    if getattr(fsdp_utils, "fully_shard_module", None) is None or not _verl_swap_breaks():
        return

    @contextmanager
    def no_swap(model: Any) -> Iterator[None]:
        yield

    fsdp_utils.maybe_patch_fsdp_module = no_swap


def _packed_logprobs() -> None:
    """verl's engine computes a packed row's log-probabilities with ``RowLogprobs`` (point 2 above)."""
    import verl.utils.torch_functional as verl_f
    import verl.workers.engine.fsdp.transformer_impl as impl

    original = verl_f.logprobs_from_logits

    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
        if logits.dim() == 2 and not verl_f.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE:
            return RowLogprobs.apply(logits, labels)
        return original(logits, labels, inplace_backward=inplace_backward)

    impl.logprobs_from_logits = logprobs_from_logits
