"""The verl engine's speed and memory levers for one base model, chosen from its size and the GPU's memory.

Three levers decide how fast verl trains a model and whether a micro-batch fits:

- **Padding removed** (verl's ``use_remove_padding``): a micro-batch's rows are concatenated into one
  packed row, position ids restarting per row, so no padding token is computed. Attention must then
  stay within each row. transformers does that from the position ids: flash-attn's kernels
  (``flash_attention_2`` / ``_3``) and this project's ``tb_varlen`` (tinker_engine/varlen.py, torch's own
  variable-length kernel) attend within each row in O(T) memory; ``sdpa`` / ``eager`` get a dense
  block-diagonal T x T mask, which computes every pair of the packed row (slower than padding on the
  CPU, docs/benchmarks.md "Packed micro-batches").
- **Gradient checkpointing**: each layer's activations are recomputed in the backward instead of kept,
  about one more forward pass (+50% of a LoRA step, whose backward computes no base weight gradient).
- **Micro-batch tokens per GPU** (verl's ``max_token_len_per_gpu``): the most tokens one forward holds.

Each lever is the operator's where set (``TB_VERL_REMOVE_PADDING``, ``TB_VERL_GRAD_CKPT``; the
micro-batch bound ``TB_ENGINE_MAX_BATCH_TOKENS`` is a ceiling the plan may lower), else chosen here:

- padding removed where a variable-length kernel runs: CUDA, and flash-attn's attention or torch's
  ``varlen_attn`` (the default ``sdpa`` is then replaced by ``tb_varlen``); kept otherwise;
- on a GPU, checkpointing off and the ceiling kept when the activations of a micro-batch of that many
  tokens fit the memory left after the weights; else checkpointing on, at the largest micro-batch that
  fits with it. Checkpointing is not turned off at the price of a smaller micro-batch: on the H100 at
  the 1.7B shape, padding removed, off at 8192 tokens took 0.85-0.95x the step time of on at 16384 with
  mixed lengths and 1.04-1.08x with equal ones, at 1.44-1.75x the peak memory, above the padded
  engine's (docs/benchmarks.md "The verl engine's levers"): a few percent either way, bought with
  memory a larger batch or a second model could use;
- on CPU ranks (no device memory to plan against): checkpointing on, the ceiling kept.

The memory model (``Shape``), per token of a micro-batch, 16-bit activations, every linear layer with
a LoRA (so each layer's input is kept for its adapter's gradient), the base frozen:

- kept per decoder layer without checkpointing, in elements: the layer input and its norm (2h), the
  query and key before and after their norms and rotation (2q + 2kv), the value (kv), the attention
  output (q), the residual and the MLP's norm (2h), the gate, its activation, the up projection and
  their product (4i); with checkpointing, each layer's input (h), plus one layer's worth while it is
  recomputed;
- the output layer: the logits (16-bit) and their gradient, plus a 16-bit temporary, 6 bytes per
  vocabulary entry;
- the weights: float32 (verl's FSDP master copy), sharded over the ranks.

The usable memory is ``USABLE`` of the GPU's total (the CUDA context, NCCL buffers and the allocator's
reserve), and the activations are counted ``HEADROOM`` times: what the model leaves out (the attention
and matmul workspaces, a layer's gradients in flight during the backward, the allocator's
fragmentation) is not measured here, and verl retries no micro-batch that runs out of memory, so the
plan errs towards a smaller micro-batch. With padding kept, the tokens computed are counted
``PADDED_TOKENS`` times the micro-batch's bound: verl bounds a micro-batch's real tokens and pads each
row to its longest, so a micro-batch of lengths spread evenly up to its longest computes about twice
its real tokens (16 datums of 64-2048 tokens: 32,592 padded of 16,858 real). Measured on the H100 at
the 1.7B shape, padded, 8192-token micro-batches without checkpointing: a 57.3 GiB peak against 24.9
GiB estimated without the headroom (2.3x; docs/benchmarks.md "The verl engine's levers"). The
estimate and the choice are logged when the model is loaded (engine.py), so an operator sees what was
chosen and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Share of the GPU's memory the estimate may fill.
USABLE = 0.75
#: How many times the modelled activations are counted (what the model leaves out, above).
HEADROOM = 1.5
#: Tokens computed per real token of a micro-batch when padding is kept (above).
PADDED_TOKENS = 2
#: The smallest micro-batch the plan goes down to.
MIN_TOKENS = 1024
#: Attention implementations that run a packed row in O(T), without a T x T mask.
VARLEN_ATTENTIONS = ("flash_attention_2", "flash_attention_3")
GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """What the memory model reads of a decoder-only transformer's config."""

    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int
    params: int

    @classmethod
    def of(cls, config: Any) -> "Shape":
        """From a transformers config (its ``text_config`` where it has one); the parameters counted as a
        dense decoder's: embeddings (and an untied output layer), per layer the attention and gated-MLP
        matrices and two norms."""
        text = getattr(config, "text_config", None) or config
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        layers, vocab = int(text.num_hidden_layers), int(text.vocab_size)
        inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
        q, kv = heads * head_dim, kv_heads * head_dim
        tied = bool(getattr(config, "tie_word_embeddings", False))
        params = vocab * hidden * (1 if tied else 2) + layers * (2 * hidden * q + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden)
        return cls(layers=layers, hidden=hidden, q_dim=q, kv_dim=kv, intermediate=inter, vocab=vocab, params=params)

    def layer_bytes(self) -> int:
        """One decoder layer's kept activations per token, without checkpointing (16-bit)."""
        return 2 * (4 * self.hidden + 3 * self.q_dim + 3 * self.kv_dim + 4 * self.intermediate)

    def token_bytes(self, checkpointed: bool) -> int:
        """A token's activations through the model and its output layer."""
        layers = self.layers * 2 * self.hidden + self.layer_bytes() if checkpointed else self.layers * self.layer_bytes()
        return layers + 6 * self.vocab

    def weight_bytes(self, ranks: int) -> int:
        return 4 * self.params // max(1, ranks)


@dataclass(frozen=True)
class Levers:
    remove_padding: bool
    attn: str
    grad_ckpt: bool
    max_tokens: int
    #: Why each lever is what it is, in the order above (the log line).
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return "; ".join(self.reasons)


def choose(shape: Shape, *, gpu_bytes: int | None, ranks: int, remove_padding: bool | None, grad_ckpt: bool | None,
           attn: str, ceiling: int, varlen: str | None, unpackable: str | None = None) -> Levers:
    """The levers for ``shape`` on a GPU of ``gpu_bytes`` (None: CPU ranks) over ``ranks`` ranks.

    ``remove_padding`` / ``grad_ckpt``: the operator's setting, None for auto. ``attn``: the configured
    attention implementation. ``ceiling``: the most tokens per micro-batch (TB_ENGINE_MAX_BATCH_TOKENS).
    ``varlen``: the name of a registered variable-length attention that runs here (``tb_varlen``), or None.
    ``unpackable``: why padding cannot be removed for this engine (then it is kept, whatever the setting).
    """
    reasons: list[str] = []
    packed_attn = attn
    if unpackable is not None:
        remove_padding = False
        reasons.append(f"padding kept ({unpackable})")
    elif remove_padding is None:
        if gpu_bytes is not None and attn in VARLEN_ATTENTIONS:
            remove_padding = True
            reasons.append(f"padding removed (auto: {attn} attends within each row)")
        elif gpu_bytes is not None and attn == "sdpa" and varlen is not None:
            remove_padding, packed_attn = True, varlen
            reasons.append(f"padding removed (auto: attention {varlen}, torch's variable-length kernel, instead of sdpa)")
        else:
            remove_padding = False
            where = "on CPU ranks" if gpu_bytes is None else f"attention {attn} has no variable-length kernel here"
            reasons.append(f"padding kept (auto: {where}, a packed row would need a dense T x T mask)")
    elif remove_padding:
        if gpu_bytes is not None and attn == "sdpa" and varlen is not None:
            packed_attn = varlen
        dense = packed_attn not in VARLEN_ATTENTIONS and packed_attn != varlen
        reasons.append("padding removed (TB_VERL_REMOVE_PADDING)" + (f", attention {packed_attn} with a block-diagonal mask" if dense else f", attention {packed_attn}"))
    else:
        reasons.append("padding kept (TB_VERL_REMOVE_PADDING)")

    if gpu_bytes is None:
        ckpt = True if grad_ckpt is None else grad_ckpt
        if grad_ckpt is None:
            reasons.append("gradient checkpointing on (auto: CPU ranks, no device memory to plan against)")
        else:
            reasons.append(f"gradient checkpointing {'on' if ckpt else 'off'} (TB_VERL_GRAD_CKPT)")
        reasons.append(f"micro-batches up to {ceiling} tokens (TB_ENGINE_MAX_BATCH_TOKENS)")
        return Levers(remove_padding, packed_attn, ckpt, ceiling, tuple(reasons))

    budget = int(gpu_bytes * USABLE) - shape.weight_bytes(ranks)
    computed = 1 if remove_padding else PADDED_TOKENS
    need = lambda tokens, ck: int(HEADROOM * computed * tokens * shape.token_bytes(ck))  # noqa: E731

    def largest(ck: bool, floor: int) -> int | None:
        tokens = ceiling
        while tokens >= floor:
            if need(tokens, ck) <= budget:
                return tokens
            tokens //= 2
        return None

    padded = "" if remove_padding else f"padded tokens counted {PADDED_TOKENS}x, "
    memory = (f"{padded}{shape.params / 1e9:.1f}B parameters, weights {shape.weight_bytes(ranks) / GIB:.1f} GiB per rank, "
              f"{budget / GIB:.1f} GiB left of {USABLE:.0%} of {gpu_bytes / GIB:.0f} GiB")
    if grad_ckpt is None:
        ckpt = need(ceiling, False) > budget
        tokens = largest(ckpt, min(MIN_TOKENS, ceiling))
        reasons.append("gradient checkpointing off (auto: the whole ceiling fits without it)" if not ckpt else
                       "gradient checkpointing on (auto: without it the micro-batch would be lowered)")
    else:
        ckpt = grad_ckpt
        tokens = largest(ckpt, min(MIN_TOKENS, ceiling))
        reasons.append(f"gradient checkpointing {'on' if ckpt else 'off'} (TB_VERL_GRAD_CKPT)")
    if tokens is None:
        tokens = min(MIN_TOKENS, ceiling)
        reasons.append(f"micro-batches up to {tokens} tokens, estimated {need(tokens, ckpt) / GIB:.1f} GiB of activations with headroom: "
                       f"over the memory left ({memory}): it may not fit; spread the model over more GPUs or turn on offload")
    else:
        bound = "the TB_ENGINE_MAX_BATCH_TOKENS ceiling" if tokens == ceiling else f"lowered from TB_ENGINE_MAX_BATCH_TOKENS={ceiling} to fit"
        reasons.append(f"micro-batches up to {tokens} tokens ({bound}; estimated {need(tokens, ckpt) / GIB:.1f} GiB "
                       f"of activations with headroom, {memory})")
    return Levers(remove_padding, packed_attn, ckpt, tokens, tuple(reasons))
