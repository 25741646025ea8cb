"""forward_backward_group (co-batching, cobatch.py): several models' forward_backward in one pass of
the base, each model's results as if it ran alone.

Each case builds every model twice with the same seed and perturbation: one twin runs its request
alone (forward_backward), the other in a group. Outputs, loss sums, accumulated gradients and the
parameters after one AdamW step are compared up to float32 summation order (helpers.ORDER_SLACK:
the base's matrix products run over more rows in the group and each adapter over its rows gathered
from the pack, the same sums blocked differently)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tinker_engine import cobatch
from tinker_engine.cobatch import forward_backward_group
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError
from tinker_engine.settings import overridden

from helpers import ORDER_SLACK, adam, assert_close_up_to_summation_order, create, datum, fb, grads, out_logprobs, params, perturb


def _request(model_id: str, loss_fn: str, data: list[dict[str, Any]], config: dict[str, Any] | None = None,
             forward_only: bool = False) -> dict[str, Any]:
    return {"model_id": model_id, "loss_fn": loss_fn, "loss_fn_config": config or {}, "forward_only": forward_only, "data": data}


def _group(engine: Engine, members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return forward_backward_group(engine.registry, {"members": members})["results"]


# Three models with different ranks, target modules and losses; datums of mixed lengths.
MODELS = [
    ("a", {"rank": 2}, 11),
    ("b", {"rank": 4, "train_mlp": False}, 12),
    ("c", {"rank": 8, "train_unembed": False, "train_attn": False}, 13),
]


def _build(engine: Engine, suffix: str) -> None:
    for name, flags, seed in MODELS:
        create(engine, name + suffix, seed=seed, **flags)
        perturb(engine, name + suffix, seed=seed)


def _requests(engine: Engine, suffix: str, vocab: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(5)

    def toks(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def tg(n: int, k: int | None = None) -> torch.Tensor:
        return torch.randint(0, vocab, (n,) if k is None else (n, k), generator=gen)

    a = [datum(toks(5), tg(5), weights=torch.rand(5, generator=gen)), datum(toks(9), tg(9, 3), weights=torch.rand(9, 3, generator=gen))]
    b = [datum(toks(n), tg(n), logprobs=-torch.rand(n, generator=gen) - 1.0, advantages=torch.randn(n, generator=gen)) for n in (3, 12)]
    c = [datum(toks(7), tg(7), logprobs=-torch.rand(7, generator=gen) - 1.0, advantages=torch.randn(7, generator=gen))]
    return [
        _request("a" + suffix, "cross_entropy", a[:1]),  # one (N,) datum: (N, K) targets are checked below
        _request("b" + suffix, "importance_sampling", b),
        _request("c" + suffix, "ppo", c, {"clip_low_threshold": 0.7, "clip_high_threshold": 1.4}),
    ] + [_request("a" + suffix + "k", "cross_entropy", a[1:])]


def _vocab(engine: Engine) -> int:
    return engine.registry.base("tiny").vocab_size


# How the group's micro-batches are laid out (packing.py): padded (what a group runs on the CPU, where
# SDPA's masked attention does not isolate packed datums), packed (what it runs where flash-attn's
# variable-length kernel does: forced here, so that the token segments of a packed row and of the
# output layer's chunks, chunked_logprobs.py, are checked on the CPU); the solo runs in the same
# layout. A 4-token output-layer chunk cuts the members' segments (and a padded row's slots).
GROUP_LAYOUTS = ["padded", "padded-small-head-chunks", "packed", "packed-small-head-chunks"]


@pytest.fixture(params=GROUP_LAYOUTS)
def group_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    packed = request.param.startswith("packed")
    monkeypatch.setattr(cobatch, "isolates_datums", lambda base: packed)
    chunk = 4 if request.param.endswith("small-head-chunks") else 1024
    with overridden(layout="packed" if packed else "padded", head_chunk_tokens=chunk):
        yield str(request.param)


def test_group_layout_follows_attention_isolation(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    base = engine.registry.base("tiny")
    assert cobatch.group_layout(base).name == "padded"  # the CPU, auto: SDPA would need a block-diagonal mask
    with overridden(layout="packed"):
        assert cobatch.group_layout(base).name == "padded"  # packed, but the attention does not isolate datums
        monkeypatch.setattr(cobatch, "isolates_datums", lambda b: True)
        assert cobatch.group_layout(base).name == "packed"
    with overridden(layout="padded"):
        assert cobatch.group_layout(base).name == "padded"


def test_group_equals_each_model_alone(engine: Engine, group_layout: str) -> None:
    vocab = _vocab(engine)
    for suffix in ("-solo", "-grp"):
        _build(engine, suffix)
        create(engine, "a" + suffix + "k", seed=14, rank=2)
        perturb(engine, "a" + suffix + "k", seed=14)
    solo_reqs = _requests(engine, "-solo", vocab)
    group_reqs = _requests(engine, "-grp", vocab)
    solo = [fb(engine, r["model_id"], r["loss_fn"], r["data"], r["loss_fn_config"]) for r in solo_reqs]
    one_by_one = _count_one_by_one(engine, [r["model_id"] for r in group_reqs])
    grouped = _group(engine, group_reqs)
    assert len(grouped) == len(solo)
    # Every decoder layer holds two members or more: they run as one grouped product. The output layer
    # runs per datum here (a datum's (N, K) targets: train.batch_logprobs), one member at a time.
    assert one_by_one and all(name.endswith("lm_head") for name in one_by_one), one_by_one
    for s, g, r in zip(solo, grouped, group_reqs):
        assert "error" not in g, g
        assert len(g["loss_fn_outputs"]) == len(s["loss_fn_outputs"])
        for i in range(len(s["loss_fn_outputs"])):
            assert out_logprobs(g, i).shape == out_logprobs(s, i).shape
            assert_close_up_to_summation_order(out_logprobs(g, i), out_logprobs(s, i), f"{r['model_id']} datum {i} logprobs")
        assert_close_up_to_summation_order(torch.tensor(g["metrics"]["loss:sum"]), torch.tensor(s["metrics"]["loss:sum"]), f"{r['model_id']} loss")
    lr = 1e-2
    for s_req, g_req in zip(solo_reqs, group_reqs):
        gs, gg = grads(engine, s_req["model_id"]), grads(engine, g_req["model_id"])
        for (name, want), got in zip(gs.items(), gg.values()):
            assert want is not None and got is not None, name
            assert_close_up_to_summation_order(got, want, f"{g_req['model_id']} grad {name}")
        engine.call("optim_step", {"model_id": s_req["model_id"], "adam": adam(lr)})
        engine.call("optim_step", {"model_id": g_req["model_id"], "adam": adam(lr)})
        for (name, want), got in zip(params(engine, s_req["model_id"]).items(), params(engine, g_req["model_id"]).values()):
            _assert_first_adam_step_close(got, want, gs[name], lr, f"{g_req['model_id']} param {name} after optim_step")


def _assert_first_adam_step_close(got: torch.Tensor, want: torch.Tensor, grad: torch.Tensor, lr: float, what: str) -> None:
    """Parameters after a first AdamW step from equal weights and gradients equal up to summation order.

    The first step moves each element by lr * g / (|g| + eps): where |g| is well above the gradient's
    rounding slack the update is insensitive to it (its derivative is lr * eps / (|g| + eps)^2), so the
    parameters agree up to the same slack; where |g| is within the slack of zero the direction itself
    is rounding (a near-cancelling sum), and the two may differ by up to the step, 2 * lr."""
    slack = ORDER_SLACK * float(grad.abs().max())
    sure = grad.abs() > 4 * slack
    assert bool(sure.any()), what
    assert_close_up_to_summation_order(got[sure], want[sure], what)
    assert float((got - want).abs().max()) <= 2 * lr * (1 + ORDER_SLACK), what


def test_a_group_of_one_is_forward_backward_bit_for_bit(engine: Engine, group_layout: str) -> None:
    # The solo run in the group's layout: the same micro-batches, the same kernels.
    vocab = _vocab(engine)
    for suffix in ("-solo", "-grp"):
        _build(engine, suffix)
    solo_req = _requests(engine, "-solo", vocab)[1]
    group_req = _requests(engine, "-grp", vocab)[1]
    solo = fb(engine, solo_req["model_id"], solo_req["loss_fn"], solo_req["data"])
    (grouped,) = _group(engine, [group_req])
    assert grouped["metrics"] == solo["metrics"]
    for i in range(2):
        assert torch.equal(out_logprobs(grouped, i), out_logprobs(solo, i))
    for want, got in zip(grads(engine, "b-solo").values(), grads(engine, "b-grp").values()):
        assert want is not None and got is not None and torch.equal(got, want)


def test_a_failing_member_fails_alone(engine: Engine) -> None:
    vocab = _vocab(engine)
    for suffix in ("-solo", "-grp"):
        _build(engine, suffix)
    solo_reqs = _requests(engine, "-solo", vocab)[:3]
    group_reqs = _requests(engine, "-grp", vocab)[:3]
    # b: a non-finite loss (an old logprob of -1e38: the ratio overflows); c: a datum the parser refuses.
    bad_b = [dict(d) for d in group_reqs[1]["data"]]
    bad_b[1] = datum([1, 2, 3], torch.tensor([1, 2, 3]), logprobs=torch.tensor([-1e38, -1.0, -1.0]), advantages=torch.ones(3))
    group_reqs[1] = {**group_reqs[1], "data": bad_b}
    group_reqs[2] = {**group_reqs[2], "data": [{"tokens": [1, 2], "loss_fn_inputs": {}}]}
    before_b = grads(engine, "b-grp")
    results = _group(engine, group_reqs)
    assert "error" not in results[0]
    assert results[1]["error"]["category"] == "user" and "not finite" in results[1]["error"]["message"]
    assert results[2]["error"]["category"] == "user" and "target_tokens" in results[2]["error"]["message"]
    # The failed members' gradients are as before; the other's equal its solo run.
    assert all(g is None for g in before_b.values()) and all(g is None for g in grads(engine, "b-grp").values())
    assert not engine.registry.model("b-grp").flat.pending
    solo = fb(engine, "a-solo", solo_reqs[0]["loss_fn"], solo_reqs[0]["data"])
    assert_close_up_to_summation_order(torch.tensor(results[0]["metrics"]["loss:sum"]), torch.tensor(solo["metrics"]["loss:sum"]), "a loss")
    for want, got in zip(grads(engine, "a-solo").values(), grads(engine, "a-grp").values()):
        assert want is not None and got is not None
        assert_close_up_to_summation_order(got, want, "a grad")


def test_forward_only_members_accumulate_nothing(engine: Engine) -> None:
    vocab = _vocab(engine)
    _build(engine, "-grp")
    reqs = _requests(engine, "-grp", vocab)[:3]
    reqs[0] = {**reqs[0], "forward_only": True}
    results = _group(engine, reqs)
    assert all("error" not in r for r in results)
    assert all(g is None for g in grads(engine, "a-grp").values())
    assert all(g is not None for g in grads(engine, "b-grp").values())


def test_group_refusals(engine: Engine) -> None:
    _build(engine, "-grp")
    with pytest.raises(UserError, match="members must be a list"):
        forward_backward_group(engine.registry, {"members": []})
    req = _request("a-grp", "cross_entropy", [datum([1, 2], torch.tensor([2, 3]))])
    results = _group(engine, [req, req])
    assert "error" not in results[0]
    assert "appears twice" in results[1]["error"]["message"]
    assert "unknown model_id" in _group(engine, [_request("nope", "cross_entropy", [])])[0]["error"]["message"]


def _count_one_by_one(engine: Engine, model_ids: list[str]) -> dict[str, int]:
    """Per LoRA layer name, how many times one of ``model_ids``' adapters ran on its own there (its
    ``lora_A`` module called, as the one-at-a-time path does; the grouped product reads the weights)."""
    base = engine.registry.base("tiny")
    assert base.peft is not None
    adapters = {engine.registry.model(m).adapter for m in model_ids}
    counts: dict[str, int] = {}

    def hook(name: str) -> Any:
        def count(*_: Any) -> None:
            counts[name] = counts.get(name, 0) + 1
        return count

    for name, module in base.peft.named_modules():
        if isinstance(module, cobatch.LoraLinear):
            for adapter in adapters & set(module.lora_A.keys()):
                module.lora_A[adapter].register_forward_hook(hook(name))
    return counts


def _equal_rank_members(engine: Engine, suffix: str, vocab: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(9)
    reqs = []
    for k, lengths in enumerate([(6,), (4, 8), (11,), (3, 5, 2)]):
        create(engine, f"e{k}{suffix}", seed=20 + k, rank=4)
        perturb(engine, f"e{k}{suffix}", seed=20 + k)
        data = [datum(torch.randint(0, vocab, (n,), generator=gen).tolist(), torch.randint(0, vocab, (n,), generator=gen))
                for n in lengths]
        reqs.append(_request(f"e{k}{suffix}", "cross_entropy", data, forward_only=k == 2))
    return reqs


@pytest.mark.parametrize("grouped", [True, False])
def test_members_run_as_one_grouped_product_per_layer(engine: Engine, grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Four members of one rank (one forward-only), unequal lengths: each equals its solo run, and no
    # adapter ran on its own in any layer (every layer holds all four); with the grouped product off
    # every adapter runs on its own in every layer, with the same results.
    monkeypatch.setattr(cobatch, "GROUPED", grouped)
    vocab = _vocab(engine)
    solo_reqs, group_reqs = _equal_rank_members(engine, "-solo", vocab), _equal_rank_members(engine, "-grp", vocab)
    solo = [fb(engine, r["model_id"], r["loss_fn"], r["data"], forward_only=r["forward_only"]) for r in solo_reqs]
    counts = _count_one_by_one(engine, [r["model_id"] for r in group_reqs])
    grouped_results = _group(engine, group_reqs)
    layers = sum(1 for m in engine.registry.base("tiny").peft.modules() if isinstance(m, cobatch.LoraLinear))
    if grouped:
        assert counts == {}
    else:
        assert len(counts) == layers and set(counts.values()) == {len(group_reqs)}
    for s, g, s_req, g_req in zip(solo, grouped_results, solo_reqs, group_reqs):
        assert "error" not in g, g
        for i in range(len(s["loss_fn_outputs"])):
            assert_close_up_to_summation_order(out_logprobs(g, i), out_logprobs(s, i), f"{g_req['model_id']} datum {i}")
        assert_close_up_to_summation_order(torch.tensor(g["metrics"]["loss:sum"]), torch.tensor(s["metrics"]["loss:sum"]))
        for (name, want), got in zip(grads(engine, s_req["model_id"]).items(), grads(engine, g_req["model_id"]).values()):
            if g_req["forward_only"]:
                assert want is None and got is None, name
            else:
                assert want is not None and got is not None, name
                assert_close_up_to_summation_order(got, want, f"{g_req['model_id']} grad {name}")


def test_a_layer_with_dropout_runs_its_adapters_one_at_a_time(engine: Engine) -> None:
    # A dropout module on one member's q_proj of the first decoder layer (in eval mode: a no-op on the
    # values) takes that layer, and only it, off the grouped product; the results stay each solo run's.
    vocab = _vocab(engine)
    solo_reqs, group_reqs = _equal_rank_members(engine, "-solo", vocab), _equal_rank_members(engine, "-grp", vocab)
    solo = [fb(engine, r["model_id"], r["loss_fn"], r["data"], forward_only=r["forward_only"]) for r in solo_reqs]
    base = engine.registry.base("tiny")
    assert base.peft is not None
    name, layer = next((n, m) for n, m in base.peft.named_modules() if isinstance(m, cobatch.LoraLinear) and n.endswith("q_proj"))
    layer.lora_dropout[engine.registry.model("e1-grp").adapter] = torch.nn.Dropout(0.1).eval()
    counts = _count_one_by_one(engine, [r["model_id"] for r in group_reqs])
    results = _group(engine, group_reqs)
    assert counts == {name: len(group_reqs)}
    for s, g in zip(solo, results):
        assert_close_up_to_summation_order(torch.tensor(g["metrics"]["loss:sum"]), torch.tensor(s["metrics"]["loss:sum"]))
    for want, got in zip(grads(engine, "e1-solo").values(), grads(engine, "e1-grp").values()):
        assert want is not None and got is not None
        assert_close_up_to_summation_order(got, want, "e1 grad")
