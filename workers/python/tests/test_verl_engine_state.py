"""The verl engine's LoRA init, sampler adapters and checkpoints, on CPU.

verl's FSDP engine is registered for CUDA only, so it cannot run here. What ``VerlEngine`` reads of
it is its ``module`` (a PEFT model: on the GPU wrapped by FSDP2, its LoRA parameters DTensors) and
its ``optimizer`` (torch AdamW). This test gives the engine exactly those, unsharded — a PEFT model
of the tiny model and an AdamW — and checks that the seeded init, the sampler adapter and the
checkpoints are the torch engine's, byte for byte where they should be, and load in both directions;
then the same with the module sharded by real FSDP2 (``fully_shard``, as verl wraps it) over two CPU
ranks (gloo), so the DTensor gather/scatter paths run too.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import BASE, create
from tinker_engine.errors import UserError
from tinker_engine.models import LoraSpec
from tinker_engine_verl.engine import BaseInfo, VerlEngine, VerlModel, _copy_into
from tinker_engine.models import seeded_lora_values

LORA = {"rank": 4, "seed": 7, "train_unembed": False, "train_mlp": True, "train_attn": True}


class StandInEngine:
    """verl's engine as VerlEngine sees it: ``module``, ``optimizer``, ``train_mode``, ``optimizer_zero_grad``."""

    def __init__(self, path: str, lora: LoraSpec) -> None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.module = get_peft_model(hf, lora.peft_config(path))
        self.optimizer = torch.optim.AdamW([p for p in self.module.parameters() if p.requires_grad], lr=1e-3)

    def train_mode(self, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad()


@pytest.fixture
def verl(tiny_model_dir: Path) -> tuple[VerlEngine, VerlModel]:
    path = str(tiny_model_dir)
    lora = LoraSpec.parse(dict(LORA))
    worker = type("Worker", (), {})()
    worker.engine = StandInEngine(path, lora)
    engine = VerlEngine()
    engine.load_base({"name": BASE, "path": path})
    model = VerlModel("m", engine.base(BASE), lora, worker)
    params = model.lora_params()  # what create_model does after verl built the model
    for (_, p), value in zip(params, seeded_lora_values([(k, tuple(p.shape)) for k, p in params], lora.seed)):
        _copy_into(p, value)
    engine.models["m"] = model
    return engine, model


def test_load_base_reports_what_the_torch_engine_does(engine: Any, verl: tuple[VerlEngine, VerlModel],
                                                      tiny_model_dir: Path) -> None:
    ve, _ = verl
    assert ve.load_base({"name": BASE, "path": str(tiny_model_dir)}) == engine.call(
        "load_base", {"name": BASE, "path": str(tiny_model_dir)})
    with pytest.raises(UserError, match="already loaded"):
        ve.load_base({"name": BASE, "path": "/elsewhere"})


def test_memory_op_answers_as_the_torch_engine(engine: Any, verl: tuple[VerlEngine, VerlModel]) -> None:
    ve, _ = verl
    ours, theirs = ve.call("memory", {"reset_peak": True}), engine.call("memory", {"reset_peak": True})
    assert sorted(ours) == sorted(theirs) == ["allocated_bytes", "device", "max_allocated_bytes", "reserved_bytes"]
    assert ours["device"] == theirs["device"] == "cpu"
    # A GPU turn handed over (release): the cached blocks go back; on the CPU there are none, the models stay.
    released = engine.call("memory", {"release": True})
    assert released == {"device": "cpu", "allocated_bytes": 0, "reserved_bytes": 0, "max_allocated_bytes": 0}


def test_seeded_init_and_sampler_adapter_equal_the_torch_engine(engine: Any, verl: tuple[VerlEngine, VerlModel],
                                                                tmp_path: Path) -> None:
    ve, _ = verl
    create(engine, "m", rank=LORA["rank"], seed=LORA["seed"], train_unembed=False)
    ve.save_sampler({"model_id": "m", "dir": str(tmp_path / "v")})
    engine.call("save_sampler", {"model_id": "m", "dir": str(tmp_path / "t")})
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "v" / name).read_bytes() == (tmp_path / "t" / name).read_bytes(), name


def test_checkpoints_load_across_engines_with_the_optimizer(engine: Any, verl: tuple[VerlEngine, VerlModel],
                                                            tmp_path: Path) -> None:
    ve, model = verl
    create(engine, "m", rank=LORA["rank"], seed=123, train_unembed=False)
    gen = torch.Generator().manual_seed(0)
    for _, p in model.lora_params():  # one AdamW step on fixed gradients
        p.grad = torch.randn(p.shape, generator=gen)
    model.engine.optimizer.step()
    model.hyper = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}

    ve.save_state({"model_id": "m", "dir": str(tmp_path / "v1"), "optimizer": True})
    engine.call("load_state", {"model_id": "m", "dir": str(tmp_path / "v1"), "optimizer": True})
    engine.call("save_state", {"model_id": "m", "dir": str(tmp_path / "t1"), "optimizer": True})
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        assert (tmp_path / "v1" / name).read_bytes() == (tmp_path / "t1" / name).read_bytes(), name
    state_v, state_t = (json.loads((tmp_path / d / "tinker_state.json").read_text()) for d in ("v1", "t1"))
    assert (state_v["lora"].pop("seed"), state_t["lora"].pop("seed")) == (7, 123)  # each model's own seed
    assert state_v == state_t
    assert json.loads((tmp_path / "v1" / "optimizer.json").read_text()) == json.loads(
        (tmp_path / "t1" / "optimizer.json").read_text())

    # back into the verl engine from a fresh state: weights, moments, steps and hyperparameters return
    for _, p in model.lora_params():
        with torch.no_grad():
            p.zero_()
    model.engine.optimizer.state.clear()
    assert ve.load_state({"model_id": "m", "dir": str(tmp_path / "t1"), "optimizer": True}) == {
        "model_id": "m", "has_optimizer": True}
    ve.save_state({"model_id": "m", "dir": str(tmp_path / "v2"), "optimizer": True})
    a, b = load_file(str(tmp_path / "v1" / "optimizer.safetensors")), load_file(str(tmp_path / "v2" / "optimizer.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "v1" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "v2" / "adapter_model.safetensors").read_bytes()
    assert json.loads((tmp_path / "v2" / "optimizer.json").read_text()) == json.loads(
        (tmp_path / "v1" / "optimizer.json").read_text())

    # without the optimizer: fresh AdamW state; a sampler directory is not a checkpoint
    ve.load_state({"model_id": "m", "dir": str(tmp_path / "t1"), "optimizer": False})
    assert all(not model.engine.optimizer.state.get(p) for _, p in model.lora_params())
    ve.save_sampler({"model_id": "m", "dir": str(tmp_path / "s")})
    with pytest.raises(UserError, match="tinker_state.json is missing"):
        ve.load_state({"model_id": "m", "dir": str(tmp_path / "s"), "optimizer": False})
    with pytest.raises(UserError, match="already exists"):
        ve.save_state({"model_id": "m", "dir": str(tmp_path / "v1"), "optimizer": False})


def test_sample_and_unknown_models_are_user_errors(verl: tuple[VerlEngine, VerlModel]) -> None:
    ve, _ = verl
    with pytest.raises(UserError, match="trains only"):
        ve.call("sample", {})
    with pytest.raises(UserError, match="unknown model_id 'x'"):
        ve.call("save_sampler", {"model_id": "x", "dir": "/tmp/x"})


# --- sharded: real FSDP2 over two CPU ranks (gloo), as verl shards the model on GPUs ---------------


def _sharded_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        lora = LoraSpec.parse(dict(LORA))
        stand_in = StandInEngine(model_dir, lora)
        mesh = init_device_mesh("cpu", (world,))
        for layer in stand_in.module.base_model.model.model.layers:  # verl's FSDP2 wrap: decoder layers, then root
            fully_shard(layer, mesh=mesh)
        fully_shard(stand_in.module, mesh=mesh)
        stand_in.optimizer = torch.optim.AdamW([p for p in stand_in.module.parameters() if p.requires_grad], lr=1e-3)
        worker = type("Worker", (), {})()
        worker.engine = stand_in
        ve = VerlEngine(rank=rank, world_size=world)
        ve.load_base({"name": BASE, "path": model_dir})
        model = VerlModel("m", ve.base(BASE), lora, worker)
        ve.models["m"] = model
        params = model.lora_params()
        assert all(isinstance(p, DTensor) for _, p in params)
        assert params[0][0] == "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
        for (_, p), value in zip(params, seeded_lora_values([(k, tuple(p.shape)) for k, p in params], lora.seed)):
            _copy_into(p, value)
        ve.save_sampler({"model_id": "m", "dir": f"{out}/sampler"})
        gen = torch.Generator().manual_seed(0)
        for _, p in params:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), p.device_mesh, p.placements)
        stand_in.optimizer.step()
        model.hyper = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
        ve.save_state({"model_id": "m", "dir": f"{out}/ck1", "optimizer": True})
        for _, p in params:
            with torch.no_grad():
                p.zero_()
        stand_in.optimizer.state.clear()
        ve.load_state({"model_id": "m", "dir": f"{out}/ck1", "optimizer": True})
        ve.save_state({"model_id": "m", "dir": f"{out}/ck2", "optimizer": True})
        for _, p in params:  # the loaded state steps
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), p.device_mesh, p.placements)
        stand_in.optimizer.step()
        # Both ranks done before either tears its group down: a rank closing its gloo pairs while the
        # other still finishes a collective's tail aborted the other once (std::terminate, SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_fsdp2_two_ranks(engine: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sharded_rank, args=(2, port, str(tiny_model_dir), str(tmp_path)), nprocs=2)
    create(engine, "m", rank=LORA["rank"], seed=LORA["seed"], train_unembed=False)
    engine.call("save_sampler", {"model_id": "m", "dir": str(tmp_path / "torch")})
    # each rank held half of every LoRA matrix; gathered, the init is the torch engine's
    assert (tmp_path / "sampler" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "torch" / "adapter_model.safetensors").read_bytes()
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        assert (tmp_path / "ck1" / name).read_bytes() == (tmp_path / "ck2" / name).read_bytes(), name
    assert len(load_file(str(tmp_path / "ck1" / "optimizer.safetensors"))) == 2 * 28
    engine.call("load_state", {"model_id": "m", "dir": str(tmp_path / "ck1"), "optimizer": True})
