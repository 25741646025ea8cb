"""grouped_lora.py: the members' LoRA products of one layer as one batched product.

On a real PEFT layer of the tiny model holding several adapters (ranks 2, 4 and 8): the grouped
product equals running each adapter over its run of tokens (cobatch._one_by_one), outputs and
gradients up to float32 summation order, and gives no gradient to an adapter whose parameters do
not require grad; its plan covers each member's tokens once."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from tinker_engine.cobatch import _one_by_one
from tinker_engine.engine import Engine
from tinker_engine.grouped_lora import _stack_a, _stack_b, _stacks, add_grouped_, make_plan, plain_weights

from helpers import assert_close_up_to_summation_order, create, perturb

RANKS = {"a": 2, "b": 4, "c": 8}


def _layer(engine: Engine, module: str = "q_proj") -> tuple[LoraLinear, dict[str, str]]:
    for name, rank in RANKS.items():
        create(engine, name, rank=rank, seed=rank)
        perturb(engine, name, seed=rank, scale=0.2)
    adapters = {name: engine.registry.model(name).adapter for name in RANKS}
    base = engine.registry.base("tiny")
    assert base.peft is not None
    layer = next(m for n, m in base.peft.named_modules() if isinstance(m, LoraLinear) and n.endswith(module))
    return layer, adapters


def test_plan_covers_each_members_tokens_once() -> None:
    runs = [("a", 0, 3), ("b", 3, 20), ("c", 25, 27)]
    plan = make_plan(runs, [1.0, 0.5, 2.0], torch.device("cpu"), torch.float32)
    total = 3 + 17 + 2
    assert plan.length == -(-total // 3)
    assert len(plan.pieces) <= 2 * len(runs)
    rows = plan.rows.view(len(plan.pieces), plan.length)
    scale = plan.scale.squeeze(-1)
    counted: list[int] = []
    for piece, k in enumerate(plan.pieces):
        name, first, end = runs[k]
        real = scale[piece] != 0
        # The piece's tokens first, its padding rows after, all within its member's run.
        assert bool((rows[piece] >= first).all() and (rows[piece] < end).all())
        assert bool(real[: int(real.sum())].all())
        assert set(scale[piece][real].tolist()) == {[1.0, 0.5, 2.0][k]}
        counted += rows[piece][real].tolist()
    assert sorted(counted) == [*range(0, 3), *range(3, 20), *range(25, 27)]
    with pytest.raises(ValueError):
        make_plan([("a", 2, 2)], [1.0], torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("start", ["no grad", "accumulated"])
@pytest.mark.parametrize("runs", [
    [("a", 0, 5), ("b", 5, 9), ("c", 9, 21)],  # unequal runs: pieces of the mean length
    [("a", 0, 7), ("c", 10, 17)],  # equal runs, a gap of tokens without LoRA, two of the ranks
    [("b", 0, 6), ("a", 6, 12), ("c", 12, 18)],  # equal runs
])
def test_grouped_equals_one_adapter_at_a_time(engine: Engine, runs: list[tuple[str, int, int]], start: str) -> None:
    # Parameters without a .grad take autograd's accumulation through the stacked weights; with one (the
    # engine's flat buffers) the grouped backward adds into it itself (grouped_lora._Product).
    layer, adapters = _layer(engine)
    runs = [(adapters[name], lo, hi) for name, lo, hi in runs]
    weights = plain_weights(layer, [name for name, _, _ in runs])
    assert weights is not None
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(21, layer.in_features, generator=gen)
    upstream = torch.randn(21, layer.out_features, generator=gen)
    # c's parameters do not require grad (a forward-only member): it must get none.
    frozen = adapters["c"]
    outcomes = []
    for grouped in (False, True):
        for name in RANKS:
            for k, p in enumerate(engine.registry.model(name).parameters()):
                p.requires_grad_(adapters[name] != frozen)
                p.grad = torch.full_like(p, 0.01 * k) if start == "accumulated" and p.requires_grad else None
        tokens = x.clone().requires_grad_(True)
        out = layer.base_layer(tokens)
        if grouped:
            scalings = [float(layer.scaling[name]) for name, _, _ in runs]
            add_grouped_(weights, tokens, out, make_plan(runs, scalings, x.device, torch.float32))
        else:
            _one_by_one(layer, tokens, out, runs)
        (out * upstream).sum().backward()
        assert tokens.grad is not None
        weight_grads = {name: (layer.lora_A[name].weight.grad, layer.lora_B[name].weight.grad) for name in adapters.values()}
        if start == "accumulated":  # the parameters of other layers keep what they had
            a_param = engine.registry.model("a").params
            assert all(p.grad is not None and bool((p.grad == 0.01 * k).all()) for k, (n, p) in enumerate(a_param)
                       if ".q_proj." not in n or ".layers.0." not in n)
        outcomes.append((out.detach(), tokens.grad, weight_grads))
    (want_out, want_dx, want_w), (got_out, got_dx, got_w) = outcomes
    assert_close_up_to_summation_order(got_out, want_out, "output")
    assert_close_up_to_summation_order(got_dx, want_dx, "input gradient")
    present = {name for name, _, _ in runs}
    for name in adapters.values():
        for want, got, which in zip(want_w[name], got_w[name], "AB"):
            if name == frozen or (name not in present and start == "no grad"):
                assert want is None and got is None, (name, which)
            else:
                assert want is not None and got is not None, (name, which)
                assert_close_up_to_summation_order(got, want, f"{name} lora_{which} gradient")


def test_what_the_grouped_form_does_not_compute_is_not_grouped(engine: Engine) -> None:
    layer, adapters = _layer(engine)
    names = list(adapters.values())
    assert plain_weights(layer, names) is not None
    layer.lora_dropout[names[1]] = torch.nn.Dropout(0.1)
    assert plain_weights(layer, names) is None
    assert plain_weights(layer, [names[0], names[2]]) is not None
    layer.lora_dropout[names[1]] = torch.nn.Dropout(0.0)
    assert plain_weights(layer, names) is not None
    layer.lora_B[names[2]] = torch.nn.Linear(RANKS["c"], layer.out_features, bias=True)
    layer.lora_bias[names[2]] = True
    assert plain_weights(layer, names) is None


@pytest.mark.parametrize("ranks", [(2, 4, 8), (4, 4, 4)])
def test_padded_stacks_outside_autograd_equal_the_differentiable_ones(ranks: tuple[int, ...]) -> None:
    # _Product's stacks (one gather where ranks differ) hold exactly what stack and pad give.
    gen = torch.Generator().manual_seed(4)
    a = [torch.randn(r, 6, generator=gen) for r in ranks]
    b = [torch.randn(5, r, generator=gen) for r in ranks]
    plan = make_plan([("x", 0, 3), ("y", 3, 13), ("z", 13, 15)], [1.0, 1.0, 1.0], torch.device("cpu"), torch.float32)
    assert len(plan.pieces) > 3  # y's run is cut into pieces: its weights repeat
    got_a, got_b = _stacks(plan, a, b)
    assert torch.equal(got_a, _stack_a(plan, a)) and torch.equal(got_b, _stack_b(plan, b))
