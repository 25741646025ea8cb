"""Where the engine runs and in which precision, read once from the environment.

- ``TB_ENGINE_DEVICE``: ``cpu``, ``cuda`` or ``cuda:N``; default cuda:0 when available, else cpu.
- ``TB_ENGINE_DTYPE``: base weights' dtype, ``float32`` | ``bfloat16`` | ``float16``; default float32
  on CPU and bfloat16 on CUDA. LoRA weights and all logprob/loss math are float32 regardless.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def placement_from_env(env: dict[str, str] | None = None) -> Placement:
    env = dict(os.environ) if env is None else env
    requested = env.get("TB_ENGINE_DEVICE", "").strip()
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"TB_ENGINE_DEVICE={requested} but CUDA is not available")
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype_name = env.get("TB_ENGINE_DTYPE", "").strip() or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise RuntimeError(f"TB_ENGINE_DTYPE must be one of {sorted(DTYPES)}, got {dtype_name!r}")
    return Placement(device=device, dtype=DTYPES[dtype_name])
