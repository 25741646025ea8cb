"""The verl engine on CPU ranks (gloo): how an agent with ``device: cpu`` runs verl's FSDP engine.

verl 0.9.1 knows CUDA / NPU / ROCm platforms only: without a GPU it still picks its CUDA platform
(``verl.plugin.platform``) and its engine registry hands out engine classes for ``cuda`` / ``npu``.
Two things make the unchanged FSDP engine run on CPU, set once before verl builds anything:

- a platform whose device is ``cpu`` (``CpuPlatform``): tensors, FSDP2's mesh and the model go to
  the CPU, the memory / synchronize / seed calls verl makes become CPU ones or no-ops, and its
  collectives use gloo;
- ``VERL_ENGINE_DEVICE=cuda`` so the registry returns the FSDP engine class (which is device-agnostic:
  it asks the platform for the device).

Arithmetic is float32 on CPU: verl's FSDP mixed precision names bf16 for parameters, but the
engine keeps fp32 here (``mixed_precision`` in ``engine_config``) so losses over N ranks can be
compared with one rank's to float32 reduction-order tolerance.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

_installed = False

#: FSDP mixed precision on CPU: parameters, reductions and buffers in float32 (no bf16 autocast).
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def on_cpu() -> bool:
    """True when this engine runs on CPU ranks (no CUDA device visible)."""
    return not torch.cuda.is_available()


class _CpuDeviceModule:
    """What verl calls on ``torch.cuda`` through its platform, answered for the CPU: ``torch.cpu``'s
    functions where they exist, zero memory figures, a ``"cpu"`` device name."""

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "get_device_name":
            return lambda *a, **k: "cpu"
        if name == "mem_get_info":
            return lambda *a, **k: (0, 0)
        if name == "get_device_properties":
            return lambda *a, **k: SimpleNamespace(name="cpu", total_memory=0)
        if name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
            return lambda *a, **k: 0
        if name in ("reset_peak_memory_stats", "empty_cache", "ipc_collect", "manual_seed", "manual_seed_all",
                    "set_device", "synchronize"):
            return lambda *a, **k: None
        raise AttributeError(f"torch.cpu has no '{name}' (verl asked for it on the CPU platform)")


def install() -> None:
    """Make verl's platform the CPU one and its engine registry hand out the FSDP classes (idempotent)."""
    global _installed
    if _installed:
        return
    # VERL_ENGINE_DEVICE=cuda (set by __main__ before verl is imported) makes verl pick its CUDA platform, replaced here.
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CpuPlatform(PlatformCUDA):
        """verl's CUDA platform with the CPU as its device and gloo as its backend."""

        _module = _CpuDeviceModule()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return self._module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:  # verl moves tensors with .to(current_device())
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        @contextmanager
        def nvtx_range(self, msg: str):  # type: ignore[override]
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

    platform_manager._current_platform = CpuPlatform()
    _installed = True
