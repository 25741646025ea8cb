"""Fused kernels in the base model's layers (``TB_ENGINE_KERNELS``, issue 35).

- ``none`` (the default): the model's own layers, as transformers writes them.
- ``liger``: Liger's Triton kernels (the ``liger-kernel`` package) replace the base model's RMSNorm,
  SwiGLU MLP and rotary embedding, in place, when the base is loaded (``apply``). Each is one fused
  kernel for what the plain layer runs as several element-wise passes over the activations, forward
  and backward. They are Triton kernels: CUDA only, so a CPU engine asked for them stops at its start
  (``check``) with a message saying so. Liger's fused linear + cross-entropy is not used: it reads the
  output layer's weight directly, so it would drop a LoRA on the output layer, and the engine already
  computes target logprobs a chunk at a time (chunked_logprobs.py).

Which model types Liger patches is Liger's own table; a base of another type loads unfused, and the
engine's log says so. The LoRA layers PEFT adds (and co-batching's grouped adapters) wrap the
projections, which the fused MLP still calls as modules. Exactness against the unfused layers is
measured on the GPU (bench/gpu/kernels.sh: the losses of both over the same steps).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from .settings import EngineSettings

log = logging.getLogger("tinker_engine.kernels")

#: What ``liger`` fuses: these switches of Liger's per-model patch function on, every other one of its
#: switches (its losses among them) off.
LIGER_FUSED = ("rope", "rms_norm", "swiglu")


def check(settings: EngineSettings, device: torch.device) -> None:
    """Refuses, at the engine's start, kernels its device cannot run or that are not installed."""
    if settings.kernels == "none":
        return
    if device.type != "cuda":
        raise RuntimeError(f"TB_ENGINE_KERNELS={settings.kernels} needs a CUDA device (Liger's kernels are Triton "
                           f"kernels), but the engine runs on {device}; unset it, or set TB_ENGINE_KERNELS=none")
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"TB_ENGINE_KERNELS=liger needs the liger-kernel package in the engine's Python ({exc}); "
                           "pip install liger-kernel, or set TB_ENGINE_KERNELS=none") from None


def apply(settings: EngineSettings, model: Any) -> None:
    """Fuses ``model``'s layers as the setting asks (after ``check``); the engine's log says what was done."""
    if settings.kernels == "none":
        return
    from liger_kernel.transformers import monkey_patch

    model_type = getattr(model.config, "model_type", None)
    patch = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if patch is None:
        log.warning("TB_ENGINE_KERNELS=liger: Liger has no kernels for model type %r; this base runs unfused", model_type)
        return
    switches = {name: name in LIGER_FUSED for name, p in inspect.signature(patch).parameters.items()
                if isinstance(p.default, bool)}
    patch(model=model, **switches)
    fused = ", ".join(name for name, on in switches.items() if on)
    log.info("TB_ENGINE_KERNELS=liger: %s fused (%s)", model_type, fused)
