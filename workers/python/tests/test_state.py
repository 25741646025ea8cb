"""save_state / load_state: training checkpoints, optimizer restore, validation, PEFT compatibility."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from helpers import adam, create, datum, fb, grads, out_logprobs, params, perturb
from tinker_engine import state as state_module
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError

TOKENS = [5, 17, 300, 42, 9, 77, 123, 8]


def _data(seed: int = 0) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in (9, 6):
        tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
        out.append(datum(tokens, torch.tensor(tokens[1:] + [0]), weights=torch.rand(n, generator=gen)))
    return out


def _train(engine: Engine, model_id: str, steps: int = 2) -> None:
    for i in range(steps):
        fb(engine, model_id, "cross_entropy", _data(i))
        engine.call("optim_step", {"model_id": model_id, "adam": adam(lr=0.02, weight_decay=0.01)})


def _trained(engine: Engine, model_id: str = "orig", **flags: bool) -> None:
    create(engine, model_id, rank=4, seed=1, **flags)
    perturb(engine, model_id, seed=3)
    _train(engine, model_id)


def _save(engine: Engine, model_id: str, directory: Path, optimizer: bool = True) -> dict[str, Any]:
    return engine.call("save_state", {"model_id": model_id, "dir": str(directory), "optimizer": optimizer})


def _load(engine: Engine, model_id: str, directory: Path, optimizer: bool) -> dict[str, Any]:
    return engine.call("load_state", {"model_id": model_id, "dir": str(directory), "optimizer": optimizer})


def _step(engine: Engine, model_id: str) -> float:
    loss = fb(engine, model_id, "cross_entropy", _data(7))["metrics"]["loss:sum"]
    engine.call("optim_step", {"model_id": model_id, "adam": adam(lr=0.02, weight_decay=0.01)})
    return loss


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.values(), b.values()))


def _optimizer_snapshot(engine: Engine, model_id: str) -> list[dict[str, torch.Tensor]] | None:
    opt = engine.registry.model(model_id).optimizer
    if opt is None:
        return None
    return [{k: v.clone() for k, v in st.items()} for st in engine.registry.model(model_id).flat.param_states(opt)]


def test_load_with_optimizer_continues_exactly(engine: Engine, tmp_path: Path) -> None:
    _trained(engine, "orig")
    ckpt = tmp_path / "ckpt"
    result = _save(engine, "orig", ckpt)
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "optimizer.json",
                     "optimizer.safetensors", "tinker_state.json"]
    assert result == {"dir": str(ckpt), "size_bytes": sum((ckpt / f).stat().st_size for f in files)}
    assert json.loads((ckpt / "tinker_state.json").read_text()) == {
        "format": 1, "base_model": "tiny", "has_optimizer": True,
        "lora": {"rank": 4, "seed": 1, "train_unembed": True, "train_mlp": True, "train_attn": True}}
    assert not list(tmp_path.glob("*.tmp-*"))

    create(engine, "copy", rank=4, seed=9)  # another seed: different initial weights
    fb(engine, "copy", "cross_entropy", _data(5))  # accumulated gradients are dropped by the load
    assert _max_diff(params(engine, "orig"), params(engine, "copy")) > 1e-3
    assert _load(engine, "copy", ckpt, optimizer=True) == {"model_id": "copy", "has_optimizer": True}
    assert all(g is None for g in grads(engine, "copy").values())
    assert all(torch.equal(x, y) for x, y in zip(params(engine, "orig").values(), params(engine, "copy").values()))
    for a, b in zip(_optimizer_snapshot(engine, "orig"), _optimizer_snapshot(engine, "copy")):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert float(b["step"]) == 2.0

    loss_orig, loss_copy = _step(engine, "orig"), _step(engine, "copy")
    assert abs(loss_orig - loss_copy) <= 1e-6
    assert _max_diff(params(engine, "orig"), params(engine, "copy")) <= 1e-6
    copy = engine.registry.model("copy")
    assert float(copy.flat.param_states(copy.optimizer)[0]["step"]) == 3.0


def test_load_without_optimizer_starts_adam_fresh(engine: Engine, tmp_path: Path) -> None:
    _trained(engine, "orig")
    ckpt = tmp_path / "ckpt"
    _save(engine, "orig", ckpt)
    create(engine, "fresh", rank=4, seed=9)
    assert _load(engine, "fresh", ckpt, optimizer=False) == {"model_id": "fresh", "has_optimizer": True}
    assert engine.registry.model("fresh").optimizer is None
    assert all(torch.equal(x, y) for x, y in zip(params(engine, "orig").values(), params(engine, "fresh").values()))

    loss_orig, loss_fresh = _step(engine, "orig"), _step(engine, "fresh")
    assert abs(loss_orig - loss_fresh) <= 1e-6  # same weights before the step
    assert _max_diff(params(engine, "orig"), params(engine, "fresh")) > 1e-4  # different Adam moments

    # A model that loads into itself without the optimizer also drops its own Adam state.
    _load(engine, "orig", ckpt, optimizer=False)
    assert engine.registry.model("orig").optimizer is None


def test_save_without_optimizer(engine: Engine, tmp_path: Path) -> None:
    _trained(engine, "orig")
    ckpt = tmp_path / "weights-only"
    result = _save(engine, "orig", ckpt, optimizer=False)
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "tinker_state.json"]
    assert result["size_bytes"] == sum((ckpt / f).stat().st_size for f in files)
    assert json.loads((ckpt / "tinker_state.json").read_text())["has_optimizer"] is False
    create(engine, "other", rank=4, seed=2)
    assert _load(engine, "other", ckpt, optimizer=False) == {"model_id": "other", "has_optimizer": False}
    assert _max_diff(params(engine, "orig"), params(engine, "other")) == 0.0

    # A model that never stepped saves an empty optimizer state; loading it is a fresh optimizer.
    create(engine, "new", rank=4, seed=5)
    _save(engine, "new", tmp_path / "never-stepped")
    _load(engine, "orig", tmp_path / "never-stepped", optimizer=True)
    assert engine.registry.model("orig").optimizer is None
    assert _max_diff(params(engine, "orig"), params(engine, "new")) == 0.0


def test_load_errors_leave_the_model_unchanged(engine: Engine, tmp_path: Path) -> None:
    _trained(engine, "orig")
    _save(engine, "orig", tmp_path / "full")
    _save(engine, "orig", tmp_path / "no-opt", optimizer=False)

    # The victim has trained weights, Adam state and accumulated gradients of its own.
    create(engine, "victim", rank=8, seed=2)
    _train(engine, "victim", steps=1)
    create(engine, "attn_only", rank=4, seed=2, train_unembed=False, train_mlp=False)
    _train(engine, "attn_only", steps=1)
    engine.call("load_base", {"name": "tiny2", "path": engine.registry.base("tiny").path})
    engine.call("create_model", {"model_id": "other_base", "base_model": "tiny2", "lora": {
        "rank": 4, "seed": 1, "train_unembed": True, "train_mlp": True, "train_attn": True}})
    _train(engine, "other_base", steps=1)
    for m in ("victim", "attn_only", "other_base"):
        fb(engine, m, "cross_entropy", _data(3))
    create(engine, "same_cfg", rank=4, seed=2)
    _train(engine, "same_cfg", steps=1)
    fb(engine, "same_cfg", "cross_entropy", _data(3))

    snapshots = {m: (params(engine, m), grads(engine, m), _optimizer_snapshot(engine, m))
                 for m in ("victim", "attn_only", "other_base", "same_cfg")}

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (tmp_path / "full").iterdir():
        if f.name != "optimizer.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())

    cases = [
        ("victim", tmp_path / "full", True, r"rank=4.*but model 'victim' has \{rank=8"),
        ("attn_only", tmp_path / "full", False, r"train_unembed=True.*train_unembed=False"),
        ("other_base", tmp_path / "full", False, r"base model 'tiny'.*base model 'tiny2'"),
        ("same_cfg", tmp_path / "no-opt", True, "has no optimizer state"),
        ("same_cfg", tmp_path / "missing", False, f"{tmp_path / 'missing'} does not exist"),
        ("same_cfg", broken, True, f"{broken / 'optimizer.safetensors'} is missing"),
    ]
    for model_id, directory, optimizer, message in cases:
        with pytest.raises(UserError, match=message):
            _load(engine, model_id, directory, optimizer)
    with pytest.raises(UserError, match="unknown model_id"):
        _load(engine, "nope", tmp_path / "full", True)
    with pytest.raises(UserError, match="'optimizer' must be a boolean"):
        engine.call("load_state", {"model_id": "victim", "dir": str(tmp_path / "full"), "optimizer": "yes"})

    # A checkpoint whose tensors disagree with its config is caught before anything changes.
    (broken / "optimizer.safetensors").write_bytes((tmp_path / "full" / "optimizer.safetensors").read_bytes())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="cannot read .*adapter_model.safetensors"):
        _load(engine, "same_cfg", broken, True)

    for m, (p, g, o) in snapshots.items():
        assert _max_diff(p, params(engine, m)) == 0.0
        assert all(x is not None and torch.equal(x, y) for x, y in zip(g.values(), grads(engine, m).values()))
        after = _optimizer_snapshot(engine, m)
        assert o is not None and after is not None
        assert all(torch.equal(a[k], b[k]) for a, b in zip(o, after) for k in a)
    _load(engine, "same_cfg", broken.parent / "full", True)  # the intact checkpoint still loads


def test_save_refuses_existing_dir_and_leaves_no_partial_checkpoint(engine: Engine, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _trained(engine, "orig")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="already exists"):
        _save(engine, "orig", existing)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="already exists"):
        _save(engine, "orig", empty)

    # A failure while writing (disk full, crash) leaves neither the checkpoint nor the temporary directory.
    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(state_module, "save_file", fail)
    target = tmp_path / "nested" / "ckpt"
    with pytest.raises(OSError, match="disk full"):
        _save(engine, "orig", target)
    assert not target.exists() and list((tmp_path / "nested").iterdir()) == []


def test_checkpoint_is_a_peft_adapter_and_matches_save_sampler(engine: Engine, tmp_path: Path,
                                                               tiny_model_dir: Path) -> None:
    _trained(engine, "orig")
    ckpt = tmp_path / "ckpt"
    _save(engine, "orig", ckpt)
    sampler = tmp_path / "sampler"
    saved = engine.call("save_sampler", {"model_id": "orig", "dir": str(sampler)})
    sampler_files = ["adapter_config.json", "adapter_model.safetensors"]
    assert saved == {"dir": str(sampler), "size_bytes": sum((sampler / f).stat().st_size for f in sampler_files)}
    for f in sampler_files:
        assert (ckpt / f).read_bytes() == (sampler / f).read_bytes()

    live = out_logprobs(fb(engine, "orig", "cross_entropy", [datum(TOKENS[:-1], torch.tensor(TOKENS[1:]))],
                           forward_only=True), 0)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(fresh, str(ckpt)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(peft_model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float(), dim=-1)
    expected = logp.gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    torch.testing.assert_close(expected, live, rtol=1e-5, atol=1e-5)
    # And the engine's own sampler reads it as an adapter_dir.
    sampled = engine.call("sample", {"base_model": "tiny", "adapter_dir": str(ckpt), "prompt": TOKENS,
                                     "num_samples": 1, "prompt_logprobs": True, "topk_prompt_logprobs": 0,
                                     "sampling_params": {"max_tokens": 1, "temperature": 0.0}})
    torch.testing.assert_close(torch.tensor(sampled["prompt_logprobs"][1:]), live, rtol=1e-5, atol=1e-5)


def test_load_into_a_fresh_engine(engine: Engine, tmp_path: Path, tiny_model_dir: Path) -> None:
    """An agent restart: a new engine process continues training from the checkpoint."""
    from tinker_engine.device import Placement

    _trained(engine, "orig", train_unembed=False)
    ckpt = tmp_path / "ckpt"
    _save(engine, "orig", ckpt)
    other = Engine(Placement(torch.device("cpu"), torch.float32))
    other.call("load_base", {"name": "tiny", "path": str(tiny_model_dir)})
    create(other, "resumed", rank=4, seed=None, train_unembed=False)
    _load(other, "resumed", ckpt, optimizer=True)
    assert abs(_step(engine, "orig") - _step(other, "resumed")) <= 1e-6
    assert _max_diff(params(engine, "orig"), params(other, "resumed")) <= 1e-6
