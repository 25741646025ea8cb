"""The agent's drain saves a model with its accumulated gradients; the restarted engine continues bit for bit."""

from __future__ import annotations

import os

import torch

from helpers import adam, create, datum, fb, grads, params, perturb
from tinker_engine.engine import Engine


def _d(vocab: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (6,), generator=gen).tolist()
    return [datum(tokens, torch.tensor(tokens[1:] + [0]))]


def test_state_with_gradients_continues_exactly(engine: Engine, tmp_path) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    create(engine, "a", seed=4)
    perturb(engine, "a")
    fb(engine, "a", "cross_entropy", _d(vocab, 1))
    engine.call("optim_step", {"model_id": "a", "adam": adam()})
    fb(engine, "a", "cross_entropy", _d(vocab, 2))  # accumulated, not yet stepped
    d = str(tmp_path / "drain")
    engine.call("save_state", {"model_id": "a", "dir": d, "optimizer": True, "gradients": True})
    assert os.path.isfile(os.path.join(d, "gradients.safetensors"))
    # A client's load (gradients not asked for) starts with none.
    create(engine, "c", seed=9)
    engine.call("load_state", {"model_id": "c", "dir": d, "optimizer": True})
    assert all(g is None for g in grads(engine, "c").values())
    # The drain's reload gets them back.
    create(engine, "b", seed=9)
    engine.call("load_state", {"model_id": "b", "dir": d, "optimizer": True, "gradients": True})
    ga, gb = list(grads(engine, "a").values()), list(grads(engine, "b").values())
    assert all(x is not None and torch.equal(x, y) for x, y in zip(ga, gb))
    for m in ("a", "b"):
        engine.call("optim_step", {"model_id": m, "adam": adam()})
    la = fb(engine, "a", "cross_entropy", _d(vocab, 3))["metrics"]["loss:sum"]
    lb = fb(engine, "b", "cross_entropy", _d(vocab, 3))["metrics"]["loss:sum"]
    assert la == lb
    assert all(torch.equal(x, y) for x, y in zip(params(engine, "a").values(), params(engine, "b").values()))
