"""Gradient accumulation, AdamW, model lifecycle and input validation of the training ops."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from helpers import adam, assert_close_up_to_summation_order, create, datum, fb, grads, lora, params, perturb
from tinker_engine.channel import encode_frame
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError
from tinker_engine.settings import overridden
from tinker_engine.tensors import tensor_to_json


def _data(vocab: int, seed: int = 0, lengths: tuple[int, ...] = (9, 5)) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out.append(datum(tokens, torch.tensor(tokens[1:] + [0]), weights=torch.rand(n, generator=gen)))
    return out


def test_new_adapter_is_deterministic_and_leaves_base_unchanged(engine: Engine) -> None:
    create(engine, "a", seed=7)
    create(engine, "b", seed=7)
    create(engine, "c", seed=8)
    pa, pb, pc = (list(params(engine, m).values()) for m in ("a", "b", "c"))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))
    a_names = list(params(engine, "a"))
    assert any(".lora_A." in n and "lm_head" in n for n in a_names)
    assert all(float(p.abs().max()) == 0.0 for n, p in params(engine, "a").items() if ".lora_B." in n)
    # B = 0: the fresh adapter computes exactly the base model's logprobs.
    vocab = engine.registry.base("tiny").vocab_size
    d = _data(vocab)[:1]
    with_adapter = fb(engine, "a", "cross_entropy", d, forward_only=True)
    p = engine.call("sample", {"base_model": "tiny", "adapter_dir": None, "prompt": d[0]["tokens"] + [0],
                               "num_samples": 1, "prompt_logprobs": True, "topk_prompt_logprobs": 0,
                               "sampling_params": {"max_tokens": 1, "temperature": 0.0}})
    base_lps = torch.tensor(p["prompt_logprobs"][1:])
    torch.testing.assert_close(with_adapter["loss_fn_outputs"][0]["logprobs"], base_lps,
                               rtol=1e-5, atol=1e-5)


def test_target_module_flags(engine: Engine) -> None:
    create(engine, "attn", train_unembed=False, train_mlp=False)
    create(engine, "mlp", train_unembed=False, train_attn=False)
    create(engine, "head", train_mlp=False, train_attn=False)

    def modules(m: str) -> set[str]:
        return {n.split(".lora_")[0].split(".")[-1] for n in params(engine, m)}

    assert modules("attn") == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert modules("mlp") == {"gate_proj", "up_proj", "down_proj"}
    assert modules("head") == {"lm_head"}
    with pytest.raises(UserError, match="at least one"):
        create(engine, "none", train_unembed=False, train_mlp=False, train_attn=False)


def test_create_model_is_idempotent_for_same_config(engine: Engine) -> None:
    create(engine, "m", rank=4, seed=1)
    before = params(engine, "m")
    assert engine.call("create_model", {"model_id": "m", "base_model": "tiny", "lora": lora(4, 1)}) == {
        "model_id": "m", "lora_rank": 4}
    assert all(torch.equal(before[n], p) for n, p in params(engine, "m").items())
    with pytest.raises(UserError, match="different configuration"):
        create(engine, "m", rank=8, seed=1)
    with pytest.raises(UserError, match="not loaded"):
        engine.call("create_model", {"model_id": "x", "base_model": "nope", "lora": lora()})


def test_unload_model(engine: Engine) -> None:
    create(engine, "gone")
    adapter = engine.registry.model("gone").adapter
    assert engine.call("unload_model", {"model_id": "gone"}) == {"model_id": "gone"}
    assert adapter not in engine.registry.base("tiny").peft.peft_config
    assert engine.call("unload_model", {"model_id": "gone"}) == {"model_id": "gone"}  # idempotent
    with pytest.raises(UserError, match="unknown model_id"):
        fb(engine, "gone", "cross_entropy", _data(10))
    create(engine, "gone")  # the id can be used again
    fb(engine, "gone", "cross_entropy", _data(10))


def test_gradient_accumulation_equals_one_batch(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    d1, d2 = _data(vocab, seed=3)
    for m in ("split", "joint"):
        create(engine, m, seed=2)
        perturb(engine, m, seed=4)
    r1 = fb(engine, "split", "cross_entropy", [d1])
    r2 = fb(engine, "split", "cross_entropy", [d2])
    rj = fb(engine, "joint", "cross_entropy", [d1, d2])
    assert rj["metrics"]["loss:sum"] == pytest.approx(r1["metrics"]["loss:sum"] + r2["metrics"]["loss:sum"], rel=1e-6)
    gs, gj = grads(engine, "split"), grads(engine, "joint")
    for (n, a), b in zip(gs.items(), gj.values()):
        assert_close_up_to_summation_order(a, b, n)
    hp = adam(lr=0.05, eps=1e-3, weight_decay=0.01)  # eps keeps step 1 from being sign(g)
    before = params(engine, "split")
    ns = engine.call("optim_step", {"model_id": "split", "adam": hp})["metrics"]["grad_norm"]
    nj = engine.call("optim_step", {"model_id": "joint", "adam": hp})["metrics"]["grad_norm"]
    assert ns == pytest.approx(nj, rel=1e-5)
    for (n, a), b in zip(params(engine, "split").items(), params(engine, "joint").values()):
        assert_close_up_to_summation_order(a, b, n)
    # The step actually moved the weights.
    assert all(not torch.equal(before[n], p) for n, p in params(engine, "split").items())
    assert grads(engine, "split") == {n: None for n in gs}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_micro_batching_matches_one_batch(engine: Engine, layout: str) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    data = _data(vocab, seed=9, lengths=(6, 11, 3, 8))
    for m in ("big", "small"):
        create(engine, m, seed=2)
        perturb(engine, m, seed=4)
    with overridden(layout=layout):
        big = fb(engine, "big", "cross_entropy", data)
    with overridden(layout=layout, max_batch_tokens=10):  # one datum per micro-batch, either layout
        small = fb(engine, "small", "cross_entropy", data)
    assert big["metrics"]["loss:sum"] == pytest.approx(small["metrics"]["loss:sum"], rel=1e-6)
    for (n, a), b in zip(grads(engine, "big").items(), grads(engine, "small").values()):
        assert_close_up_to_summation_order(a, b, n)


def test_forward_only_accumulates_nothing(engine: Engine) -> None:
    create(engine, "fo")
    r = fb(engine, "fo", "cross_entropy", _data(engine.registry.base("tiny").vocab_size), forward_only=True)
    assert r["metrics"]["loss:sum"] > 0
    assert all(g is None for g in grads(engine, "fo").values())


def _adamw_by_hand(p0: dict[str, torch.Tensor], g: dict[str, torch.Tensor], m: dict, v: dict, step: int,
                   lr: float, b1: float, b2: float, eps: float, wd: float, clip: float) -> tuple[dict, float]:
    norm = math.sqrt(sum(float((x.double() ** 2).sum()) for x in g.values()))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    out = {}
    for n, p in p0.items():
        gn = g[n].double() * coef
        m[n] = b1 * m.get(n, torch.zeros_like(gn)) + (1 - b1) * gn
        v[n] = b2 * v.get(n, torch.zeros_like(gn)) + (1 - b2) * gn * gn
        mhat = m[n] / (1 - b1 ** step)
        vhat = v[n] / (1 - b2 ** step)
        out[n] = (p.double() * (1 - lr * wd) - lr * mhat / (vhat.sqrt() + eps)).float()
    return out, norm


def test_optim_step_equals_adamw_by_hand(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    create(engine, "opt", seed=5)
    perturb(engine, "opt", seed=6)
    m: dict = {}
    v: dict = {}
    steps = [  # (lr, b1, b2, eps, wd, clip): the second step changes every hyperparameter
        (0.01, 0.8, 0.9, 1e-6, 0.1, 0.5),
        (0.003, 0.85, 0.97, 1e-7, 0.3, 0.0),
    ]
    for step, (lr, b1, b2, eps, wd, clip) in enumerate(steps, start=1):
        fb(engine, "opt", "cross_entropy", _data(vocab, seed=step))
        g = {n: x for n, x in grads(engine, "opt").items()}
        p0 = params(engine, "opt")
        expected, norm = _adamw_by_hand(p0, g, m, v, step, lr, b1, b2, eps, wd, clip)
        if clip > 0:
            assert norm > clip * 2, "the test needs a clipped step"
        metrics = engine.call("optim_step", {"model_id": "opt", "adam": adam(lr, b1, b2, eps, wd, clip)})["metrics"]
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert metrics["learning_rate"] == lr
        for n, p in params(engine, "opt").items():
            torch.testing.assert_close(p, expected[n], rtol=1e-5, atol=1e-7, msg=lambda s: f"step {step} {n}: {s}")
        assert all(x is None for x in grads(engine, "opt").values())


def test_optim_step_without_gradients(engine: Engine) -> None:
    create(engine, "idle")
    before = params(engine, "idle")
    metrics = engine.call("optim_step", {"model_id": "idle", "adam": adam(weight_decay=0.5)})["metrics"]
    assert metrics["grad_norm"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in params(engine, "idle").items())
    # The bounds come from protocol.json: the engine checks a request frame's args before the op runs.
    def reply(hp: dict[str, Any]) -> dict[str, Any]:
        return engine.reply(encode_frame({"id": 1, "op": "optim_step", "args": {"model_id": "idle", "adam": hp}})[4:])

    assert reply(adam(weight_decay=0.5))["ok"]
    assert reply(adam(beta1=1.5))["error"] == {"category": "user",
                                              "message": "optim_step: args.adam.beta1: 1.5 breaks exclusiveMaximum 1"}
    assert reply({"beta1": 0.9})["error"] == {"category": "user",
                                             "message": "optim_step: args.adam: missing required field 'learning_rate'"}
    assert all(torch.equal(before[n], p) for n, p in params(engine, "idle").items())


# --- user errors change nothing ------------------------------------------------------------------

def _bad_requests(vocab: int) -> list[tuple[str, str, list[dict], dict, str]]:
    good = _data(vocab, seed=1)[0]
    n = len(good["tokens"])
    t = good["tokens"]
    nan_adv = datum(t, torch.tensor(t), logprobs=torch.zeros(n), advantages=torch.zeros(n))
    nan_adv["loss_fn_inputs"]["advantages"]["data"][2] = float("nan")
    inf_adv = datum(t, torch.tensor(t), logprobs=torch.zeros(n), advantages=torch.zeros(n))
    inf_adv["loss_fn_inputs"]["advantages"]["data"][0] = float("inf")
    return [
        ("cross_entropy", "shape", [good, datum(t, torch.tensor(t[:-1]))], {},
         r"datum 1: target_tokens has shape \[%d\] but the datum has %d tokens" % (n - 1, n)),
        ("cross_entropy", "weights", [good, datum(t, torch.tensor(t), weights=torch.ones(n + 1))], {},
         r"datum 1: weights has shape \[%d\] but target_tokens has shape \[%d\]" % (n + 1, n)),
        ("cross_entropy", "token", [good, datum(t[:-1] + [vocab], torch.tensor(t))], {},
         r"datum 1 tokens: token id %d at position %d is outside the vocabulary" % (vocab, n - 1)),
        ("cross_entropy", "target", [good, datum(t, torch.tensor(t[:-1] + [-1]))], {},
         r"datum 1: target token id -1 is outside the vocabulary"),
        ("nll", "loss", [good], {}, "supported: cross_entropy, importance_sampling, ppo, cispo, dro"),
        ("importance_sampling", "missing", [good], {}, r"requires loss_fn_inputs\['logprobs'\]"),
        ("ppo", "nan", [nan_adv], {}, "datum 0: advantages contains NaN"),
        ("cispo", "inf", [inf_adv], {}, "datum 0: advantages contains NaN or infinite"),
        ("dro", "beta", [nan_adv], {}, r"requires loss_fn_config\['beta'\]"),
        ("ppo", "2d", [datum(t, torch.tensor([t, t]).T, logprobs=torch.zeros(n, 2), advantages=torch.zeros(n, 2))],
         {}, r"must have shape \(N,\)"),
    ]


def test_user_errors_leave_gradients_unchanged(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    create(engine, "ue")
    perturb(engine, "ue")
    fb(engine, "ue", "cross_entropy", _data(vocab, seed=2))
    before = grads(engine, "ue")
    for loss_fn, label, data, config, message in _bad_requests(vocab):
        with pytest.raises(UserError, match=message):
            fb(engine, "ue", loss_fn, data, config)
        after = grads(engine, "ue")
        assert all(torch.equal(before[n], g) for n, g in after.items()), label


def test_server_error_mid_batch_restores_gradients(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    create(engine, "se")
    perturb(engine, "se")
    fb(engine, "se", "cross_entropy", _data(vocab, seed=2))
    before = grads(engine, "se")
    from tinker_engine import losses

    calls = {"n": 0}
    original = losses.LOSSES["cross_entropy"]

    def failing(lp, inputs, config):  # second micro-batch fails after the first one's backward
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return original.fn(lp, inputs, config)

    monkeypatch.setitem(losses.LOSSES, "cross_entropy",
                        losses.LossSpec("cross_entropy", failing, (), ("weights",), {}, allows_topk=True))
    with overridden(max_batch_tokens=1), pytest.raises(RuntimeError, match="boom"):  # one datum per micro-batch
        fb(engine, "se", "cross_entropy", _data(vocab, seed=3))
    assert calls["n"] == 2
    assert all(torch.equal(before[n], g) for n, g in grads(engine, "se").items())


class _MemoryLimit:
    """A device that holds at most ``tokens`` tokens of one forward: a larger micro-batch raises what
    CUDA's allocator raises (torch.OutOfMemoryError), from the decoder's forward."""

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.tokens, self.seen, self.refused = tokens, [], 0
        self.handle = engine.registry.base("tiny").hf.get_decoder().register_forward_pre_hook(self.check, with_kwargs=True)

    def check(self, _module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.seen.append(int(ids.numel()))
        if ids.numel() > self.tokens:
            self.refused += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate for {ids.numel()} tokens")


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_out_of_memory_retries_with_smaller_micro_batches(engine: Engine, layout: str) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    data = _data(vocab, seed=9, lengths=(6, 11, 3, 8))
    for m in ("fits", "oom"):
        create(engine, m, seed=2)
        perturb(engine, m, seed=4)
    # What the retry must equal: the same op with micro-batches of at most 16 tokens from the start.
    with overridden(layout=layout, max_batch_tokens=16):
        want = fb(engine, "fits", "cross_entropy", data)
    first = fb(engine, "oom", "cross_entropy", data[:1])  # a gradient already accumulated: kept, not doubled
    limit = _MemoryLimit(engine, 16)
    try:
        with overridden(layout=layout, max_batch_tokens=64):
            got = fb(engine, "oom", "cross_entropy", data)
            # 64 refused, then 32 (a micro-batch of more than 16 tokens), then 16 fits; kept for the base.
            assert limit.refused == 2 and engine.registry.base("tiny").fit_tokens == 16
            assert max(limit.seen[limit.refused:]) <= 16
            # A later op starts at the bound that fits: nothing refused.
            refused = limit.refused
            fb(engine, "oom", "cross_entropy", data, forward_only=True)
            assert limit.refused == refused
    finally:
        limit.handle.remove()
        engine.registry.base("tiny").fit_tokens = None
    assert got["metrics"]["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], rel=1e-6)
    for a, b in zip(got["loss_fn_outputs"], want["loss_fn_outputs"]):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-6)
    # The accumulated gradient is the first op's plus the retried op's, as without the out-of-memory.
    create(engine, "ref", seed=2)
    perturb(engine, "ref", seed=4)
    fb(engine, "ref", "cross_entropy", data[:1])
    with overridden(layout=layout, max_batch_tokens=16):
        fb(engine, "ref", "cross_entropy", data)
    for (n, a), b in zip(grads(engine, "oom").items(), grads(engine, "ref").values()):
        assert_close_up_to_summation_order(a, b, n)
    del first


def test_out_of_memory_with_a_datum_that_cannot_be_split_fails_and_keeps_the_gradients(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    data = _data(vocab, seed=9, lengths=(6, 11))
    create(engine, "big")
    perturb(engine, "big", seed=4)
    fb(engine, "big", "cross_entropy", data[:1])
    before = grads(engine, "big")
    limit = _MemoryLimit(engine, 8)
    try:
        with overridden(max_batch_tokens=32), pytest.raises(torch.OutOfMemoryError, match="cannot split them further: a datum has 11 tokens"):
            fb(engine, "big", "cross_entropy", data)
    finally:
        limit.handle.remove()
        engine.registry.base("tiny").fit_tokens = None
    assert all(torch.equal(before[n], g) for n, g in grads(engine, "big").items())


def test_tensor_json_round_trip() -> None:
    t = torch.tensor([[1.5, -2.25e-7], [3.0, 0.1]], dtype=torch.float32)
    j = tensor_to_json(t)
    assert j["shape"] == [2, 2] and j["dtype"] == "float32"
    from tinker_engine.tensors import tensor_from_json

    assert torch.equal(tensor_from_json(j, "x"), t)
    with pytest.raises(UserError, match="needs 4 values"):
        tensor_from_json({"dtype": "float32", "shape": [2, 2], "data": [1.0]}, "x")
    with pytest.raises(UserError, match="int64 data must be integers"):
        tensor_from_json({"dtype": "int64", "shape": [1], "data": [1.5]}, "x")
