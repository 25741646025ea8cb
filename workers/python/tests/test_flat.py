"""The adapter's flat layout (flat.py): the LoRA parameters and their gradients live in one buffer
each, and an optim_step over it moves the weights as AdamW over the separate tensors does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import adam, create, datum, fb, grads, params, perturb
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError


def _data(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in (9, 6, 11):
        tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
        out.append(datum(tokens, torch.tensor(tokens[1:] + [0]), weights=torch.rand(n, generator=gen)))
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_weights_and_gradients_are_views_of_one_buffer_each(engine: Engine) -> None:
    create(engine, "m", rank=4, seed=1)
    m = engine.registry.model("m")
    assert len(m.params) > 10
    assert all(_storage(p) == _storage(m.flat.weight) for _, p in m.params)
    fb(engine, "m", "cross_entropy", _data(0))
    # Backward accumulated into the views (autograd adds into an existing .grad in place).
    assert all(p.grad is not None and _storage(p.grad) == _storage(m.flat.grad) for _, p in m.params)
    assert float(m.flat.grad.abs().sum()) > 0
    engine.call("optim_step", {"model_id": "m", "adam": adam()})
    assert all(_storage(p) == _storage(m.flat.weight) for _, p in m.params)
    assert all(_storage(p.grad) == _storage(m.flat.grad) for _, p in m.params)
    assert float(m.flat.grad.abs().sum()) == 0.0 and not m.flat.pending


def test_steps_equal_adamw_over_separate_tensors(engine: Engine) -> None:
    """Two steps with weight decay and clipping against torch's AdamW and clip_grad_norm_ over
    separate copies of the tensors, fed the same gradients. AdamW is elementwise, so only rounding
    can differ: the CPU kernels take a vectorised path or a scalar tail by an element's position in
    its tensor, which the flat layout shifts (an FMA against a multiply and an add: ~1 ulp per op,
    a few ops per step). A step moves a weight by up to ~lr, so the difference is a few ulps of the
    update (lr * 1e-6 is ~8 ulps of lr) on top of a few ulps of the weight (rtol 1e-6). The clipping norm is one reduction over all
    elements against a norm of per-tensor norms: both are blocked float32 sums with error of order
    log2(n) * 6e-8 relative, well under 1e-5."""
    create(engine, "m", rank=4, seed=1)
    perturb(engine, "m", seed=2)
    hp = adam(lr=0.02, weight_decay=0.01, grad_clip_norm=0.05)
    ref = [p.detach().clone().requires_grad_(True) for p in params(engine, "m").values()]
    opt = torch.optim.AdamW(ref, lr=hp["learning_rate"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    for seed in (3, 4):
        fb(engine, "m", "cross_entropy", _data(seed))
        for r, g in zip(ref, grads(engine, "m").values()):
            r.grad = g
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref, hp["grad_clip_norm"]))
        opt.step()
        got = engine.call("optim_step", {"model_id": "m", "adam": hp})["metrics"]["grad_norm"]
        assert ref_norm > hp["grad_clip_norm"]  # the clip is active
        assert got == pytest.approx(ref_norm, rel=1e-5)
        for (name, w), r in zip(params(engine, "m").items(), ref):
            torch.testing.assert_close(w, r.detach(), rtol=1e-6, atol=hp["learning_rate"] * 1e-6, msg=lambda s: f"{name}: {s}")


def test_optim_step_without_gradients_changes_nothing(engine: Engine) -> None:
    create(engine, "m", rank=4, seed=1)
    perturb(engine, "m", seed=2)
    fb(engine, "m", "cross_entropy", _data(0))
    engine.call("optim_step", {"model_id": "m", "adam": adam(weight_decay=0.1)})
    m = engine.registry.model("m")
    before = params(engine, "m")
    state = [{k: v.clone() for k, v in st.items()} for st in m.flat.param_states(m.optimizer)]
    # No forward_backward since the step: no weight decay, no step count, grad_norm 0.
    result = engine.call("optim_step", {"model_id": "m", "adam": adam(weight_decay=0.1)})
    assert result["metrics"]["grad_norm"] == 0.0
    assert all(torch.equal(before[n], w) for n, w in params(engine, "m").items())
    after = m.flat.param_states(m.optimizer)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, after) for k in a)
    assert float(after[0]["step"]) == 1.0


def test_forward_only_leaves_pending_gradients_alone(engine: Engine) -> None:
    create(engine, "m", rank=4, seed=1)
    perturb(engine, "m", seed=2)
    fb(engine, "m", "cross_entropy", _data(0))
    kept = grads(engine, "m")
    fb(engine, "m", "cross_entropy", _data(1), forward_only=True)
    assert all(torch.equal(kept[n], g) for n, g in grads(engine, "m").items())


def test_load_refuses_uneven_adam_state(engine: Engine, tmp_path: Path) -> None:
    """A checkpoint whose AdamW state has different step counts per parameter (another engine could
    write one) cannot be held by one flat optimizer: a clear error, and the model is unchanged."""
    from safetensors.torch import load_file, save_file
    import json

    create(engine, "m", rank=4, seed=1)
    perturb(engine, "m", seed=2)
    fb(engine, "m", "cross_entropy", _data(0))
    engine.call("optim_step", {"model_id": "m", "adam": adam()})
    ckpt = tmp_path / "ckpt"
    engine.call("save_state", {"model_id": "m", "dir": str(ckpt), "optimizer": True})
    meta = json.loads((ckpt / "optimizer.json").read_text())
    first = sorted(meta["step"])[0]
    meta["step"][first] = 5.0
    (ckpt / "optimizer.json").write_text(json.dumps(meta))
    before = params(engine, "m")
    with pytest.raises(UserError, match="different step counts"):
        engine.call("load_state", {"model_id": "m", "dir": str(ckpt), "optimizer": True})
    assert all(torch.equal(before[n], w) for n, w in params(engine, "m").items())
    # State for only some parameters: the same error.
    tensors = load_file(str(ckpt / "optimizer.safetensors"))
    del meta["step"][first]
    for moment in ("exp_avg", "exp_avg_sq"):
        del tensors[f"{moment}/{first}"]
    save_file(tensors, str(ckpt / "optimizer.safetensors"))
    (ckpt / "optimizer.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="only some parameters"):
        engine.call("load_state", {"model_id": "m", "dir": str(ckpt), "optimizer": True})
