"""load_base's ``dtype`` (the preset's model dtype): the base weights load in it, per base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinker_engine.device import Placement
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError


def test_dtype_per_base_model_overrides_the_engine_default(tiny_model_dir: Path) -> None:
    eng = Engine(Placement(device=torch.device("cpu"), dtype=torch.float32), sampler_cache_size=2)
    eng.call("load_base", {"name": "default", "path": str(tiny_model_dir)})
    eng.call("load_base", {"name": "half", "path": str(tiny_model_dir), "dtype": "bfloat16"})
    dtypes = {name: {p.dtype for p in base.hf.parameters()} for name, base in eng.registry.bases.items()}
    assert dtypes == {"default": {torch.float32}, "half": {torch.bfloat16}}
    # A LoRA on the bfloat16 base trains (float32 adapter) and gives a finite loss.
    eng.call("create_model", {"model_id": "m", "base_model": "half", "lora": {"rank": 4, "seed": 0}})
    out = eng.call("forward_backward", {
        "model_id": "m", "loss_fn": "cross_entropy",
        "data": [{"tokens": [5, 17, 42, 99], "loss_fn_inputs": {
            "target_tokens": {"data": [17, 42, 99, 7], "dtype": "int64", "shape": [4]},
            "weights": {"data": [1.0, 1.0, 1.0, 1.0], "dtype": "float32", "shape": [4]}}}],
    })
    assert torch.isfinite(torch.tensor(out["metrics"]["loss:sum"]))


def test_unknown_dtype_is_a_user_error(tiny_model_dir: Path) -> None:
    eng = Engine(Placement(device=torch.device("cpu"), dtype=torch.float32), sampler_cache_size=2)
    with pytest.raises(UserError, match="dtype must be one of"):
        eng.call("load_base", {"name": "x", "path": str(tiny_model_dir), "dtype": "int8"})
    assert "x" not in eng.registry.bases
