"""VeOmni as the verl engine's second strategy (``TB_VERL_STRATEGY=veomni``, the preset's
``parallelism.strategy: veomni``).

verl 0.9.1 ships a VeOmni engine (``verl.workers.engine.veomni``, a subclass of its FSDP engine, so
the rest of this engine — train/eval modes, the optimizer step, DTensor LoRA parameters — is the
same), but it applies no LoRA: it reads ``lora_rank`` and builds the plain model (its source says
"TODO: support VeOmni LoRA"), so a LoRA model would silently be trained in full. ``lora_build``
closes that gap without changing verl's code: while a model is created it wraps the two VeOmni
builders verl's engine calls — the model VeOmni builds gets this model's PEFT LoRA adapters (the
torch engine's ``LoraSpec.peft_config``), and VeOmni's parallelizer is told it wraps a PEFT model
(``is_peft_model=True``, as VeOmni's own trainer passes for LoRA).

What else VeOmni needs here: veomni 0.1.12 (verl's pin 0.1.11 fails under transformers 5.17);
attention ``sdpa`` (VeOmni's default rewrites to a flash-attn implementation), eager ops, no
torch.compile; ``init_device`` ``meta`` only when it shards (more than one rank; VeOmni refuses it on
one), else ``cuda``. How each was found: docs/engines/verl.md, "VeOmni".
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from tinker_engine.models import LoraSpec
from tinker_engine.train import AdamParams

from . import cpu

# The LoRA of the model being created (create_model runs one at a time on every rank).
_building: dict[str, Any] = {}
_installed = False


def _install() -> None:
    """Wraps verl's VeOmni builders once; outside ``lora_build`` they behave as verl's."""
    global _installed
    if _installed:
        return
    import verl.workers.engine.veomni.transformer_impl as impl

    build_model, parallelize = impl.build_foundation_model, impl.build_parallelize_model

    def build_with_lora(*args: Any, **kwargs: Any) -> Any:
        module = build_model(*args, **kwargs)
        if not _building:
            return module
        from peft import get_peft_model

        if _building["grad_ckpt"]:
            module.enable_input_require_grads()
        return get_peft_model(module, _building["lora"].peft_config(_building["path"]))

    def parallelize_peft(module: Any, **kwargs: Any) -> Any:
        if cpu.on_cpu() and kwargs.get("mixed_precision") is not None:
            # verl builds float32 weights only with mixed precision on, whose FSDP policy computes
            # in bf16: on CPU ranks the parameters stay float32 (cpu.py's precision).
            kwargs["mixed_precision"] = dataclasses.replace(kwargs["mixed_precision"], param_dtype="float32")
        return parallelize(module, **({**kwargs, "is_peft_model": True} if _building else kwargs))

    impl.build_foundation_model, impl.build_parallelize_model = build_with_lora, parallelize_peft
    if cpu.on_cpu():  # VeOmni's memory log asks the CUDA allocator, which a CPU rank does not have
        impl.log_gpu_memory_usage = lambda *a, **k: None
    _installed = True


@contextlib.contextmanager
def lora_build(lora: LoraSpec, path: str, grad_ckpt: bool) -> Iterator[None]:
    """Models VeOmni builds inside the block get ``lora``'s adapters."""
    _install()
    _building.update(lora=lora, path=path, grad_ckpt=grad_ckpt)
    try:
        yield
    finally:
        _building.clear()


def engine_config(world_size: int, offload: bool, max_tokens: int, attn: str) -> Any:
    from verl.workers.config import VeOmniEngineConfig

    return VeOmniEngineConfig(
        strategy="veomni", forward_only=False, use_dynamic_bsz=True, max_token_len_per_gpu=max_tokens,
        use_remove_padding=False, use_torch_compile=False,
        attn_implementation=attn, moe_implementation="eager",
        # mixed_precision on: float32 weights (verl loads bf16 ones without it); on CPU ranks the
        # compute stays float32 too (parallelize_peft above). One CPU rank builds on the CPU.
        mixed_precision=True, enable_full_shard=True,
        init_device="meta" if world_size > 1 else ("cpu" if cpu.on_cpu() else "cuda"),
        param_offload=offload, optimizer_offload=offload)


def optimizer_config() -> Any:
    from verl.workers.config import VeOmniOptimizerConfig

    # Built with Tinker's AdamParams defaults (protocol.json); each optim_step then applies the job's adam.
    adam = AdamParams.parse({})
    return VeOmniOptimizerConfig(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), weight_decay=adam.weight_decay,
                                 clip_grad=adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf"),
                                 total_training_steps=1, lr_warmup_steps=0, lr_scheduler_type="constant")
