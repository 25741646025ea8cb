"""Where the engine runs and in which precision, from the engine's settings (settings.py).

- device (``TB_ENGINE_DEVICE``): ``cpu``, ``cuda`` or ``cuda:N``; default cuda:0 when available, else cpu.
- dtype (``TB_ENGINE_DTYPE``): base weights' dtype, ``float32`` | ``bfloat16`` | ``float16``; default
  float32 on CPU and bfloat16 on CUDA. LoRA weights and all logprob/loss math are float32 regardless.
- on CUDA, cuDNN's attention is left out of ``scaled_dot_product_attention`` unless
  ``TB_ENGINE_CUDNN_ATTENTION`` asks for it (settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .settings import DTYPES as DTYPE_NAMES
from .settings import EngineSettings, current

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    @property
    def device_name(self) -> str:
        """"cpu" or "cuda:N", as ``hello`` reports it."""
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return f"cuda:{index}"
        return self.device.type


def placement_from_env(settings: EngineSettings | None = None) -> Placement:
    """The placement the settings ask for (default: the engine's, read from its environment)."""
    s = current() if settings is None else settings
    if s.device:
        device = torch.device(s.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"TB_ENGINE_DEVICE={s.device} but CUDA is not available")
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda" and not s.cudnn_attention:
        # cuDNN's attention builds an execution plan per new (batch, length) shape (tens of ms each):
        # every decode step of a batch that requests joined is a new shape (TB_ENGINE_CUDNN_ATTENTION).
        torch.backends.cuda.enable_cudnn_sdp(False)
    if device.type == "cuda" and s.memory_fraction is not None:
        # Agents sharing the GPU (a preset's gpu_memory): this process's allocator stops at its share.
        torch.cuda.set_per_process_memory_fraction(s.memory_fraction, device)
    kernels.check(s, device)
    dtype_name = s.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    return Placement(device=device, dtype=DTYPES[dtype_name])
