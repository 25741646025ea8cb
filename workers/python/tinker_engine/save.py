"""``save_sampler``: write a model's adapter as a standard PEFT adapter directory.

The directory holds ``adapter_config.json`` (``base_model_name_or_path`` = the base's absolute
path, ``inference_mode`` true) and ``adapter_model.safetensors`` with PEFT's usual key names, so
``PeftModel.from_pretrained(base, dir)`` and vLLM's LoRA loader can read it. Only the LoRA A/B
matrices are written (never a copy of lm_head, even when lm_head is a LoRA target). Files are
written under temporary names and renamed into place, so a reader never sees a half-written file.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from .models import ADAPTER_FILES, Registry, TrainingModel
from .params import get_str
from .rollback import device_copies


def _normalise_config(path: str) -> None:
    """Sorted keys and target_modules (PEFT keeps them in a set), so equal adapters write equal files."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def capture_adapter(model: TrainingModel, on_device: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """The adapter's PEFT config (for this base, inference mode) and a copy of its LoRA tensors,
    owned by the caller: later training steps do not change them. The copy is in CPU memory, or
    with ``on_device`` on the model's device (one multi-tensor kernel; ``CapturedState.host`` moves it)."""
    base = model.base
    assert base.peft is not None
    config = copy.deepcopy(base.peft.peft_config[model.adapter])
    config.base_model_name_or_path = base.path
    config.inference_mode = True
    state = sorted(get_peft_model_state_dict(base.peft, adapter_name=model.adapter, save_embedding_layers=False).items())
    if on_device:
        return config, dict(zip([k for k, _ in state], device_copies([v for _, v in state])))
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state}
    return config, tensors


def write_captured_adapter(config: Any, tensors: dict[str, torch.Tensor], directory: str) -> int:
    """Write ``ADAPTER_FILES`` of a captured adapter into the existing ``directory``; returns their bytes."""
    config.save_pretrained(directory)
    _normalise_config(os.path.join(directory, "adapter_config.json"))
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    return sum(os.path.getsize(os.path.join(directory, fname)) for fname in ADAPTER_FILES)


def write_adapter_files(model: TrainingModel, directory: str) -> int:
    """Write ``ADAPTER_FILES`` straight into the existing ``directory``; returns their total bytes.

    The caller makes this atomic (a temporary directory renamed into place).
    """
    return write_captured_adapter(*capture_adapter(model), directory)


def write_adapter(model: TrainingModel, directory: str) -> int:
    """Write (or overwrite) the adapter files in ``directory``; returns their total bytes."""
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-adapter-", dir=directory)
    try:
        size = write_adapter_files(model, tmp)
        for fname in ADAPTER_FILES:
            os.replace(os.path.join(tmp, fname), os.path.join(directory, fname))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return size


def save_sampler(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    model = registry.model(get_str(args, "model_id"))
    directory = get_str(args, "dir")
    size = write_adapter(model, directory)
    return {"dir": directory, "size_bytes": size}
