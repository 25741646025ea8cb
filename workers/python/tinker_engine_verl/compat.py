"""verl 0.9.1 against newer torch: one adjustment, applied only where a probe shows it is needed.

verl's FSDP2 wrap (``verl.utils.fsdp_utils.apply_fsdp2``) swaps torch's ``FSDPModule`` for a subclass
that also derives from ``abc.ABC`` while it shards a module that is an ABC (PEFT's LoRA layers are:
``BaseTunerLayer`` is one). Under torch 2.13 the class fully_shard then builds from that subclass
cannot be assigned to the module ("__class__ assignment: 'FSDPLinear' object layout differs from
'Linear'"), so an untied model with a LoRA on ``lm_head`` (Tinker's ``train_unembed``, on by default)
fails in create_model. torch 2.13's own wrapper class assigns fine to such modules, so where the probe
fails, verl's swap is turned off (``maybe_patch_fsdp_module`` yields without swapping).
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from typing import Any, Iterator

_checked = False


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
    from verl.utils import fsdp_utils

    if getattr(fsdp_utils, "fully_shard_module", None) is None or not _verl_swap_breaks():
        return

    @contextmanager
    def no_swap(model: Any) -> Iterator[None]:
        yield

    fsdp_utils.maybe_patch_fsdp_module = no_swap
