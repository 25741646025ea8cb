"""The verl engine's own settings, read from its environment once (``tinker_engine.settings`` says how).

The agent sets ``TB_VERL_STRATEGY`` and ``TB_VERL_OFFLOAD`` from its models' preset entries
(workers/adapters/verl.ts ``verlLaunch``), and ``TB_VERL_GRAD_CKPT`` and ``TB_VERL_REMOVE_PADDING``
from the models' preset fields where they set them, else the user's from its configuration, with
``TB_VERL_ATTN`` (queues/infra/config.ts); ``TB_VERL_RECORD`` and
``TB_VERL_RECORD_MAX_TOKENS`` are internal (benches write CI fixtures with them). The settings it shares
with the torch engine (``TB_ENGINE_MAX_BATCH_TOKENS``, the log level) are ``tinker_engine.settings``'.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinker_engine.settings import Loaded, auto_flag, choice, flag, positive_int, variable

#: verl's FSDP2 (default) or FSDP engine, or its VeOmni engine (veomni.py).
STRATEGIES = ("fsdp2", "fsdp", "veomni")
#: The attention implementations of transformers the models may be built with.
ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass(frozen=True)
class VerlSettings:
    #: ``TB_VERL_STRATEGY``: the verl engine that trains (one per engine process).
    strategy: str = variable("TB_VERL_STRATEGY", choice(*STRATEGIES), "fsdp2", STRATEGIES)
    #: ``TB_VERL_OFFLOAD``: parameters and optimizer state in CPU memory between ops (verl's
    #: ``param_offload``/``optimizer_offload``).
    offload: bool = variable("TB_VERL_OFFLOAD", flag, False)
    #: ``TB_VERL_GRAD_CKPT``: gradient checkpointing; ``auto`` (None): chosen from the model's size and
    #: the GPU's memory (levers.py), on for CPU ranks.
    grad_ckpt: bool | None = variable("TB_VERL_GRAD_CKPT", auto_flag, None)
    #: ``TB_VERL_REMOVE_PADDING``: verl's ``use_remove_padding`` (a micro-batch's rows packed into one,
    #: no padding computed); ``auto`` (None): on where a variable-length attention kernel runs (levers.py).
    remove_padding: bool | None = variable("TB_VERL_REMOVE_PADDING", auto_flag, None)
    #: ``TB_VERL_ATTN``: the models' attention implementation.
    attn: str = variable("TB_VERL_ATTN", choice(*ATTENTIONS), "sdpa", ATTENTIONS)
    #: ``TB_VERL_RECORD`` (internal): a directory; each forward_backward of at most ``record_max_tokens``
    #: tokens writes its translation's inputs and outputs there as JSON (the fixtures of test_verl_translate.py).
    record: str | None = variable("TB_VERL_RECORD", str, None)
    #: ``TB_VERL_RECORD_MAX_TOKENS`` (internal): the largest forward_backward recorded, in tokens.
    record_max_tokens: int = variable("TB_VERL_RECORD_MAX_TOKENS", positive_int, 512)


_VERL = Loaded(VerlSettings)
#: The verl engine's settings (read at the first call; ``VerlEngine`` makes it as the engine starts).
current = _VERL.get
overridden = _VERL.overridden
