"""A non-finite loss, gradient or step is a user error naming the datum, and leaves the model exactly as it was."""

from __future__ import annotations

import pytest
import torch

from helpers import adam, create, datum, fb, grads, params, perturb
from tinker_engine import losses
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError
from tinker_engine.settings import overridden


def _ce(vocab: int, seed: int, n: int = 7) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return datum(tokens, torch.tensor(tokens[1:] + [0]))


def _is(vocab: int, seed: int, old_lp: float, n: int = 7) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    lps = torch.full((n,), -3.0)
    lps[2] = old_lp
    return datum(tokens, torch.tensor(tokens[1:] + [0]), logprobs=lps, advantages=torch.ones(n))


def _state(engine: Engine, model_id: str) -> dict:
    """Weights, gradients and AdamW state by parameter position (comparable across twin models)."""
    m = engine.registry.model(model_id)
    out: dict = {}
    w, g = list(params(engine, model_id).values()), list(grads(engine, model_id).values())
    for i, st in enumerate(m.flat.param_states(m.optimizer)):
        out[i] = {"w": w[i], "g": g[i], **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}}
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _same(x, y):
                return False
        elif x is None or y is None:
            if x is not y:
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _twins(engine: Engine, vocab: int) -> None:
    """Two identical models with one step and some accumulated gradient behind them."""
    for m in ("a", "b"):
        create(engine, m, seed=3)
        perturb(engine, m)
        fb(engine, m, "cross_entropy", [_ce(vocab, 1)])
        engine.call("optim_step", {"model_id": m, "adam": adam()})
        fb(engine, m, "cross_entropy", [_ce(vocab, 2)])


def test_non_finite_loss_rolls_back_and_names_the_datum(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    _twins(engine, vocab)
    before = _state(engine, "a")
    # The fault found in issue 13: an old logprob of -1e38 makes the importance ratio infinite.
    bad = [_is(vocab, 5, -3.0), _is(vocab, 6, -1e38)]
    with pytest.raises(UserError, match=r"datum 1: the loss is -inf .*nothing was applied"):
        fb(engine, "a", "importance_sampling", bad)
    assert _same(_state(engine, "a"), before)
    # Also in its own micro-batch after a good one was backpropagated.
    with overridden(max_batch_tokens=7), pytest.raises(UserError, match=r"datum 1: the loss"):
        fb(engine, "a", "importance_sampling", bad)
    assert _same(_state(engine, "a"), before)
    # The model goes on exactly like its twin that never saw the bad request.
    for m in ("a", "b"):
        fb(engine, m, "importance_sampling", [_is(vocab, 5, -3.0)])
        r = engine.call("optim_step", {"model_id": m, "adam": adam()})
        assert r["metrics"]["grad_norm"] > 0
    assert _same(_state(engine, "a"), _state(engine, "b"))


def test_non_finite_gradient_rolls_back(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    _twins(engine, vocab)
    before = _state(engine, "a")
    original = losses.LOSSES["cross_entropy"]

    def finite_loss_infinite_grad(lp, inputs, config):
        lp.register_hook(lambda g: g * float("inf"))
        return original.fn(lp, inputs, config)

    monkeypatch.setitem(losses.LOSSES, "cross_entropy",
                        losses.LossSpec("cross_entropy", finite_loss_infinite_grad, (), ("weights",), {}, allows_topk=True))
    with pytest.raises(UserError, match=r"datums 0\.\.1: the gradient is not finite"):
        fb(engine, "a", "cross_entropy", [_ce(vocab, 7), _ce(vocab, 8)])
    assert _same(_state(engine, "a"), before)


def test_non_finite_step_rolls_back(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    _twins(engine, vocab)
    before = _state(engine, "a")
    # Decoupled weight decay multiplies by (1 - lr*wd) = -1e40: infinite in float32. Clipping also
    # rescales the gradients in place, which the rollback must undo too.
    with pytest.raises(UserError, match="non-finite.*nothing was applied"):
        engine.call("optim_step", {"model_id": "a", "adam": adam(lr=1e30, weight_decay=1e10, grad_clip_norm=1e-3)})
    assert _same(_state(engine, "a"), before)
    # A step size beyond float32 makes torch raise halfway through the parameters (weight decay applied).
    with pytest.raises(UserError, match="overflows float32.*nothing was applied"):
        engine.call("optim_step", {"model_id": "a", "adam": adam(lr=1e38, weight_decay=1e-3)})
    assert _same(_state(engine, "a"), before)
    for m in ("a", "b"):
        engine.call("optim_step", {"model_id": m, "adam": adam()})
    assert _same(_state(engine, "a"), _state(engine, "b"))
    after = params(engine, "a")
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
