"""Each loss's value and adapter gradient vs a direct torch computation.

The reference path runs every datum on its own (no padding): model logits -> log_softmax -> gather
-> the loss formula written out here -> backward. The engine batches and pads datums, so this
checks both the loss semantics and the batching.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from helpers import create, datum, fb, grads, out_logprobs, perturb, zero_grads
from tinker_engine import losses
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError

TOL = {"rtol": 1e-5, "atol": 1e-5}
LENGTHS = (7, 12, 4)  # different lengths: the engine pads them into one batch
MODEL = "m-loss"

Formula = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def _tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def _reference(engine: Engine, items: list[tuple[list[int], torch.Tensor, dict[str, torch.Tensor]]],
               formula: Formula) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    model = engine.registry.model(MODEL)
    base = model.base
    base.activate(model.adapter, trainable=True)
    zero_grads(engine, MODEL)
    total = torch.zeros(())
    lps: list[torch.Tensor] = []
    for tokens, targets, inputs in items:
        logits = base.hf(input_ids=torch.tensor([tokens])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        if targets.dim() == 1:
            lp = logp[torch.arange(len(tokens)), targets]
        else:
            lp = torch.gather(logp, 1, targets)
        lps.append(lp.detach())
        total = total + formula(lp, inputs)
    total.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.params}
    zero_grads(engine, MODEL)
    return float(total.detach()), lps, ref_grads


def _check(engine: Engine, loss_fn: str, items: list[tuple[list[int], torch.Tensor, dict[str, torch.Tensor]]],
           formula: Formula, config: dict[str, float] | None = None) -> dict:
    ref_loss, ref_lps, ref_grads = _reference(engine, items, formula)
    result = fb(engine, MODEL, loss_fn, [datum(t, tg, **inp) for t, tg, inp in items], config)
    got = grads(engine, MODEL)
    assert math.isclose(result["metrics"]["loss:sum"], ref_loss, rel_tol=1e-5, abs_tol=1e-5)
    for i, lp in enumerate(ref_lps):
        torch.testing.assert_close(out_logprobs(result, i), lp, **TOL)
    nonzero = 0
    for name, g in ref_grads.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], g, **TOL, msg=lambda m: f"{name}: {m}")
        nonzero += int(g.abs().max() > 1e-6)
    assert nonzero == len(ref_grads), "every LoRA matrix should receive a gradient"
    return result


@pytest.fixture
def setup(engine: Engine) -> tuple[Engine, torch.Generator, int]:
    create(engine, MODEL, rank=4, seed=3)
    perturb(engine, MODEL, seed=11)
    return engine, torch.Generator().manual_seed(5), engine.registry.base("tiny").vocab_size


def _current_lps(engine: Engine, token_lists: list[list[int]], target_lists: list[torch.Tensor]) -> list[torch.Tensor]:
    result = fb(engine, MODEL, "cross_entropy",
                [datum(t, tg) for t, tg in zip(token_lists, target_lists)], forward_only=True)
    return [out_logprobs(result, i) for i in range(len(token_lists))]


def test_cross_entropy_1d(setup) -> None:
    engine, gen, vocab = setup
    items = []
    for n in LENGTHS:
        tokens = _tokens(gen, n, vocab)
        items.append((tokens, torch.tensor(tokens[1:] + [1]), {"weights": torch.rand(n, generator=gen)}))
    _check(engine, "cross_entropy", items, lambda lp, inp: -(inp["weights"] * lp).sum())


def test_cross_entropy_without_weights_is_all_ones(setup) -> None:
    engine, gen, vocab = setup
    items = [(_tokens(gen, n, vocab), torch.randint(0, vocab, (n,), generator=gen), {}) for n in LENGTHS]
    _check(engine, "cross_entropy", items, lambda lp, inp: -lp.sum())


def test_cross_entropy_negative_weights(setup) -> None:
    engine, gen, vocab = setup
    items = []
    for n in LENGTHS:
        w = torch.randn(n, generator=gen)
        w[0] = -2.0
        items.append((_tokens(gen, n, vocab), torch.randint(0, vocab, (n,), generator=gen), {"weights": w}))
    _check(engine, "cross_entropy", items, lambda lp, inp: -(inp["weights"] * lp).sum())


def test_cross_entropy_topk_targets(setup) -> None:
    engine, gen, vocab = setup
    k = 3
    items = []
    for n in LENGTHS:
        targets = torch.randint(0, vocab, (n, k), generator=gen)
        items.append((_tokens(gen, n, vocab), targets, {"weights": torch.rand(n, k, generator=gen)}))
    result = _check(engine, "cross_entropy", items,
                    lambda lp, inp: -sum((inp["weights"][:, j] * lp[:, j]).sum() for j in range(k)))
    assert result["loss_fn_outputs"][0]["logprobs"]["shape"] == [LENGTHS[0], k]


def _rl_items(engine: Engine, gen: torch.Generator, vocab: int, log_ratio: Callable[[int], torch.Tensor]):
    token_lists = [_tokens(gen, n, vocab) for n in LENGTHS]
    target_lists = [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]
    lps = _current_lps(engine, token_lists, target_lists)
    items = []
    for tokens, targets, lp in zip(token_lists, target_lists, lps):
        n = len(tokens)
        adv = torch.randn(n, generator=gen)
        q = lp - log_ratio(n)  # so that exp(lp - q) = exp(log_ratio)
        items.append((tokens, targets, {"logprobs": q, "advantages": adv}))
    return items


def test_importance_sampling_is_not_truncated(setup) -> None:
    engine, gen, vocab = setup
    items = _rl_items(engine, gen, vocab, lambda n: torch.full((n,), 1.5))  # ratio e^1.5 ~ 4.5
    result = _check(engine, "importance_sampling", items,
                    lambda lp, inp: -(torch.exp(lp - inp["logprobs"]) * inp["advantages"]).sum())
    ratio = torch.exp(out_logprobs(result, 0) - items[0][2]["logprobs"])
    assert float(ratio.min()) > 4.0  # well above any truncation at 2


def _ratios(n: int) -> torch.Tensor:
    return torch.linspace(math.log(0.3), math.log(3.0), n)  # spans both clip edges


def test_ppo_custom_thresholds(setup) -> None:
    engine, gen, vocab = setup
    lo, hi = 0.6, 1.7
    items = _rl_items(engine, gen, vocab, _ratios)

    def ppo(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        r = torch.exp(lp - inp["logprobs"])
        a = inp["advantages"]
        clipped = torch.where(r < lo, torch.full_like(r, lo), torch.where(r > hi, torch.full_like(r, hi), r))
        return -torch.where(r * a < clipped * a, r * a, clipped * a).sum()

    custom = _check(engine, "ppo", items, ppo, {"clip_low_threshold": lo, "clip_high_threshold": hi})
    zero_grads(engine, MODEL)
    default = fb(engine, MODEL, "ppo", [datum(t, tg, **inp) for t, tg, inp in items])
    assert abs(custom["metrics"]["loss:sum"] - default["metrics"]["loss:sum"]) > 1e-3


def test_ppo_default_thresholds(setup) -> None:
    engine, gen, vocab = setup
    items = _rl_items(engine, gen, vocab, _ratios)

    def ppo(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        r = torch.exp(lp - inp["logprobs"])
        a = inp["advantages"]
        return -torch.minimum(r * a, r.clamp(0.8, 1.2) * a).sum()

    _check(engine, "ppo", items, ppo)


def test_cispo(setup) -> None:
    engine, gen, vocab = setup
    lo, hi = 0.7, 1.4
    items = _rl_items(engine, gen, vocab, _ratios)

    def cispo(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = torch.exp(lp - inp["logprobs"]).clamp(lo, hi).detach()
        return -(weight * lp * inp["advantages"]).sum()

    _check(engine, "cispo", items, cispo, {"clip_low_threshold": lo, "clip_high_threshold": hi})


def test_dro(setup) -> None:
    engine, gen, vocab = setup
    beta = 0.7
    items = _rl_items(engine, gen, vocab, lambda n: torch.randn(n, generator=gen))

    def dro(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        return -(lp * inp["advantages"]).sum() + 0.5 * beta * ((lp - inp["logprobs"]) ** 2).sum()

    _check(engine, "dro", items, dro, {"beta": beta})


# --- the pure functions and their config parsing ---------------------------------------------------

def test_pure_loss_values() -> None:
    lp = torch.tensor([-1.0, -2.0])
    q = torch.tensor([-1.0 - math.log(3.0), -2.0])  # ratios 3 and 1
    a = torch.tensor([1.0, -1.0])
    inputs = {"logprobs": q, "advantages": a}
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert losses.importance_sampling(lp, inputs, {}).item() == pytest.approx(-(3.0 - 1.0))
    assert losses.ppo(lp, inputs, cfg).item() == pytest.approx(-(1.2 - 1.0))
    assert losses.cispo(lp, inputs, cfg).item() == pytest.approx(-(1.2 * -1.0 * 1.0 + 1.0 * -2.0 * -1.0))
    assert losses.dro(lp, inputs, {"beta": 2.0}).item() == pytest.approx(-((-1.0 - math.log(3.0) ** 2) + 2.0))
    assert losses.cross_entropy(lp, {"weights": torch.tensor([2.0, -1.0])}, {}).item() == pytest.approx(2.0 - 2.0)


def test_config_validation() -> None:
    with pytest.raises(UserError, match="beta"):
        losses.get_loss("dro").parse_config({})
    with pytest.raises(UserError, match="unknown keys"):
        losses.get_loss("ppo").parse_config({"clip_low": 0.5})
    with pytest.raises(UserError, match="finite"):
        losses.get_loss("ppo").parse_config({"clip_low_threshold": float("nan")})
    with pytest.raises(UserError, match="supported: cross_entropy, importance_sampling, ppo, cispo, dro"):
        losses.get_loss("mse")
    assert losses.get_loss("ppo").parse_config({"clip_high_threshold": "1.5"}) == {
        "clip_low_threshold": 0.8, "clip_high_threshold": 1.5}
