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

from helpers import adam, create, datum, fb, grads, out_logprobs, params, perturb, zero_grads
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
    assert list(result["loss_fn_outputs"][0]["logprobs"].shape) == [LENGTHS[0], k]


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
    with pytest.raises(UserError, match="supported: cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce"):
        losses.get_loss("mse")
    assert losses.get_loss("ppo").parse_config({"clip_high_threshold": "1.5"}) == {
        "clip_low_threshold": 0.8, "clip_high_threshold": 1.5}


# --- SDK 0.38: per-token clip thresholds, gspo, stable_reinforce, cispo's one-sided default ---------

def _clamp(r: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
    lo_t = torch.as_tensor(lo, dtype=r.dtype).expand_as(r)
    hi_t = torch.as_tensor(hi, dtype=r.dtype).expand_as(r)
    return torch.where(r < lo_t, lo_t, torch.where(r > hi_t, hi_t, r))


def _ppo_ref(r: torch.Tensor, a: torch.Tensor, lo, hi) -> torch.Tensor:
    c = _clamp(r, lo, hi)
    return -torch.where(r * a < c * a, r * a, c * a).sum()


def _params_after_step(engine: Engine, loss_fn: str, items, formula: Formula, config=None) -> None:
    """One AdamW step after the engine's forward_backward equals one after the reference's backward."""
    before = params(engine, MODEL)
    zero_grads(engine, MODEL)
    model = engine.registry.model(MODEL)
    model.base.activate(model.adapter, trainable=True)
    total = torch.zeros(())
    for tokens, targets, inputs in items:
        logp = torch.log_softmax(model.base.hf(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
        total = total + formula(logp[torch.arange(len(tokens)), targets], inputs)
    total.backward()
    ref = {n: p.detach().clone() for n, p in model.params}
    opt = torch.optim.AdamW([p for _, p in model.params], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    opt.step()
    expected = params(engine, MODEL)
    # Back to the starting point, then the engine's own step.
    with torch.no_grad():
        for n, p in model.params:
            p.copy_(before[n])
    zero_grads(engine, MODEL)
    model.optimizer = None
    fb(engine, MODEL, loss_fn, [datum(t, tg, **inp) for t, tg, inp in items], config)
    engine.call("optim_step", {"model_id": MODEL, "adam": adam(lr=1e-2)})
    got = params(engine, MODEL)
    moved = 0
    for n, p in expected.items():
        torch.testing.assert_close(got[n], p, **TOL, msg=lambda m: f"{n}: {m}")
        moved += int((p - ref[n]).abs().max() > 1e-6)
    assert moved == len(expected), "every LoRA matrix should move in the step"


def test_ppo_per_token_thresholds(setup) -> None:
    engine, gen, vocab = setup
    items = _rl_items(engine, gen, vocab, _ratios)
    for _, _, inp in items:
        n = inp["advantages"].shape[0]
        inp["clip_low_threshold"] = torch.linspace(0.5, 0.9, n)
        inp["clip_high_threshold"] = torch.linspace(1.1, 2.5, n)
    # The config's thresholds are overridden by the datum's own.
    _check(engine, "ppo", items,
           lambda lp, inp: _ppo_ref(torch.exp(lp - inp["logprobs"]), inp["advantages"],
                                    inp["clip_low_threshold"], inp["clip_high_threshold"]),
           {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})


def test_cispo_default_is_one_sided(setup) -> None:
    engine, gen, vocab = setup
    items = _rl_items(engine, gen, vocab, lambda n: torch.linspace(math.log(0.05), math.log(8.0), n))

    def cispo(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = _clamp(torch.exp(lp - inp["logprobs"]), 0.0, 4.0).detach()
        return -(weight * lp * inp["advantages"]).sum()

    _check(engine, "cispo", items, cispo)


def test_cispo_per_token_high_threshold(setup) -> None:
    engine, gen, vocab = setup
    items = _rl_items(engine, gen, vocab, _ratios)
    for _, _, inp in items:
        inp["clip_high_threshold"] = torch.linspace(1.0, 2.0, inp["advantages"].shape[0])

    def cispo(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = _clamp(torch.exp(lp - inp["logprobs"]), 0.0, inp["clip_high_threshold"]).detach()
        return -(weight * lp * inp["advantages"]).sum()

    _check(engine, "cispo", items, cispo)


def _gspo_ref(lo, hi) -> Formula:
    def gspo(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        m = inp["sequence_ratio_mask"] != 0
        seq_log_ratio = (lp.detach() - inp["logprobs"])[m].sum() / m.sum()
        s = torch.exp(seq_log_ratio) * torch.exp(lp - lp.detach())  # value s, gradient of lp
        return _ppo_ref(s, inp["advantages"], lo, hi)
    return gspo


def _gspo_items(engine, gen, vocab, log_ratio):
    items = _rl_items(engine, gen, vocab, log_ratio)
    for _, _, inp in items:
        n = inp["advantages"].shape[0]
        mask = torch.zeros(n)
        mask[n // 3:] = 1.0  # a prompt-like head outside the ratio
        inp["sequence_ratio_mask"] = mask
        inp["advantages"] = inp["advantages"] * mask
    return items


@pytest.mark.parametrize("shift", [0.0005, 0.1, -0.1])
def test_gspo_default_thresholds(setup, shift: float) -> None:
    engine, gen, vocab = setup
    # Random per-token log ratios around `shift`: the sequence ratio lands inside or outside
    # [1 - 3e-4, 1 + 4e-4], and tokens of one datum share it.
    items = _gspo_items(engine, gen, vocab, lambda n: shift + 0.01 * torch.randn(n, generator=gen))
    _check(engine, "gspo", items, _gspo_ref(1.0 - 3e-4, 1.0 + 4e-4))


def test_gspo_config_and_per_token_thresholds(setup) -> None:
    engine, gen, vocab = setup
    items = _gspo_items(engine, gen, vocab, lambda n: 0.3 * torch.randn(n, generator=gen))
    _check(engine, "gspo", items, _gspo_ref(0.9, 1.1), {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    for _, _, inp in items:
        n = inp["advantages"].shape[0]
        inp["clip_low_threshold"] = torch.full((n,), 0.95)
        inp["clip_high_threshold"] = torch.linspace(1.0, 1.5, n)
    zero_grads(engine, MODEL)
    _check(engine, "gspo", items, lambda lp, inp: _gspo_ref(inp["clip_low_threshold"], inp["clip_high_threshold"])(lp, inp))


def test_gspo_without_mask_uses_nonzero_advantages(setup) -> None:
    engine, gen, vocab = setup
    items = _gspo_items(engine, gen, vocab, lambda n: 0.2 * torch.randn(n, generator=gen))
    without = [(t, tg, {k: v for k, v in inp.items() if k != "sequence_ratio_mask"}) for t, tg, inp in items]

    def ref(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        return _gspo_ref(0.8, 1.25)(lp, {**inp, "sequence_ratio_mask": (inp["advantages"] != 0).float()})

    _check(engine, "gspo", without, ref, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25})


def test_gspo_params_after_one_step(setup) -> None:
    engine, gen, vocab = setup
    items = _gspo_items(engine, gen, vocab, lambda n: 0.05 * torch.randn(n, generator=gen))
    _params_after_step(engine, "gspo", items, _gspo_ref(0.9, 1.1), {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})


def _stable_items(engine, gen, vocab, log_ratio):
    """Datums whose first third is prompt (no advantage, mask 0) and the rest sampled tokens."""
    items = _rl_items(engine, gen, vocab, log_ratio)
    out = []
    for tokens, targets, inp in items:
        n = len(tokens)
        mask = torch.zeros(n)
        mask[n // 3:] = 1.0
        out.append((tokens, targets, {"advantages": inp["advantages"] * mask,
                                      "stability_logprobs": inp["logprobs"] * mask, "stability_mask": mask}))
    return out


def _stable_ref(kl_coeff: float, hi) -> Formula:
    def stable(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        m = inp["stability_mask"]
        log_r = (lp - inp["stability_logprobs"]) * m
        r = torch.exp(log_r)
        hi_t = torch.as_tensor(hi, dtype=r.dtype).expand_as(r)
        w = torch.where(r > hi_t, hi_t, r).detach()
        pg = -(w * inp["advantages"] * lp * m).sum()
        return pg + kl_coeff * ((r - 1.0 - log_r) * m).sum()
    return stable


def test_stable_reinforce_default(setup) -> None:
    engine, gen, vocab = setup
    items = _stable_items(engine, gen, vocab, _ratios)  # ratios 0.3 .. 3: none truncated at 4
    _check(engine, "stable_reinforce", items, _stable_ref(0.0, 4.0))


def test_stable_reinforce_truncation_and_kl(setup) -> None:
    engine, gen, vocab = setup
    items = _stable_items(engine, gen, vocab, lambda n: torch.linspace(math.log(0.2), math.log(9.0), n))
    _check(engine, "stable_reinforce", items, _stable_ref(0.3, 2.0), {"kl_coeff": 0.3, "clip_high_threshold": 2.0})


def test_stable_reinforce_per_token_high_threshold(setup) -> None:
    # Per-token clip_high_threshold (an SDK 0.38 loss input) overrides the config's, token by token.
    engine, gen, vocab = setup
    items = _stable_items(engine, gen, vocab, lambda n: torch.linspace(math.log(0.2), math.log(9.0), n))
    for _, _, inp in items:
        inp["clip_high_threshold"] = torch.linspace(1.0, 3.0, inp["advantages"].shape[0])

    def ref(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        return _stable_ref(0.2, inp["clip_high_threshold"])(lp, inp)

    _check(engine, "stable_reinforce", items, ref, {"kl_coeff": 0.2, "clip_high_threshold": 100.0})


def test_stable_reinforce_params_after_one_step(setup) -> None:
    engine, gen, vocab = setup
    items = _stable_items(engine, gen, vocab, lambda n: 0.3 * torch.randn(n, generator=gen))
    _params_after_step(engine, "stable_reinforce", items, _stable_ref(0.1, 4.0), {"kl_coeff": 0.1})


def test_stable_reinforce_refuses_advantages_outside_sampled_tokens(setup) -> None:
    engine, gen, vocab = setup
    tokens, targets, inp = _stable_items(engine, gen, vocab, _ratios)[0]
    inp["advantages"][0] = 1.0
    with pytest.raises(UserError, match="nonzero advantages only on sampled tokens.*position 0"):
        fb(engine, MODEL, "stable_reinforce", [datum(tokens, targets, **inp)])


def test_per_token_threshold_checks(setup) -> None:
    engine, gen, vocab = setup
    tokens, targets, inp = _rl_items(engine, gen, vocab, _ratios)[0]
    n = len(tokens)
    with pytest.raises(UserError, match="clip_low_threshold exceeds clip_high_threshold"):
        fb(engine, MODEL, "ppo", [datum(tokens, targets, **inp, clip_low_threshold=torch.full((n,), 1.5))])
    with pytest.raises(UserError, match="marks no token"):
        fb(engine, MODEL, "gspo", [datum(tokens, targets, **inp, sequence_ratio_mask=torch.zeros(n))])
    with pytest.raises(UserError, match="kl_coeff"):
        losses.get_loss("stable_reinforce").parse_config({"kl_coeff": -1})


def test_catalogue_and_engine_functions_must_agree(tmp_path) -> None:
    """The engine reads its losses from the catalogue the API reads (queues/contract/losses.json): a loss
    there without a function here, or a function here without a loss there, stops the import."""
    import json

    catalogue = json.loads(losses.CATALOGUE_FILE.read_text())
    assert set(losses.load_catalogue()) == set(catalogue["losses"])
    extra = {"losses": {**catalogue["losses"], "mse": catalogue["losses"]["cross_entropy"]}}
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    with pytest.raises(RuntimeError, match="but the engine implements"):
        losses.load_catalogue(tmp_path / "extra.json")
    fewer = {"losses": {k: v for k, v in catalogue["losses"].items() if k != "gspo"}}
    (tmp_path / "fewer.json").write_text(json.dumps(fewer))
    with pytest.raises(RuntimeError, match="but the engine implements"):
        losses.load_catalogue(tmp_path / "fewer.json")


def test_a_new_loss_is_its_catalogue_entry_and_its_function(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a loss: an entry in the catalogue and a function of the same name. Its rules come from the
    entry alone: the generic checker applies them, with no code of its own."""
    import json

    catalogue = json.loads(losses.CATALOGUE_FILE.read_text())
    catalogue["losses"]["toy"] = {
        "inputs": ["advantages"], "optional_inputs": ["margin"], "server_inputs": [], "provenance": False, "topk": False,
        "config": {"margin": {"default": 2.0, "above": 1}, "scale": {"default": None, "at_least": -3}},
        "ordered": [["scale", "margin"]],
        "datum_rules": [{"some_nonzero": "advantages", "message": "toy needs an advantage"}],
    }
    (tmp_path / "toy.json").write_text(json.dumps(catalogue))
    monkeypatch.setitem(losses._FUNCTIONS, "toy", lambda lp, inputs, config: -(lp * inputs["advantages"]).sum())
    toy = losses.load_catalogue(tmp_path / "toy.json")["toy"]
    assert toy.required_inputs == ("advantages",) and not toy.allows_topk
    with pytest.raises(UserError, match=r"loss 'toy' requires loss_fn_config\['scale'\]"):
        toy.parse_config({})
    with pytest.raises(UserError, match=r"loss_fn_config\['scale'\] must be >= -3, got -4$"):
        toy.parse_config({"scale": -4})
    with pytest.raises(UserError, match="loss_fn_config: scale must not exceed margin"):
        toy.parse_config({"scale": 3})
    # margin may come per token: its bound is checked per datum, on the values the datum uses.
    config = toy.parse_config({"scale": "0.5", "margin": 1})
    assert config == {"margin": 1.0, "scale": 0.5}
    adv = torch.tensor([0.0, 1.0])
    with pytest.raises(UserError, match="^datum 3: margin must be > 1$"):
        toy.check({"advantages": adv}, config, "datum 3")
    toy.check({"advantages": adv, "margin": torch.tensor([1.5, 2.0])}, config, "datum 3")
    with pytest.raises(UserError, match="^datum 3: scale exceeds margin$"):
        toy.check({"advantages": adv, "margin": torch.tensor([2.0, 1.25])}, toy.parse_config({"scale": 1.5}), "datum 3")
    with pytest.raises(UserError, match="^datum 3: toy needs an advantage$"):
        toy.check({"advantages": torch.zeros(2), "margin": torch.tensor([1.5, 2.0])}, config, "datum 3")


def test_the_catalogue_may_hold_only_rules_the_checker_knows(tmp_path) -> None:
    import json

    catalogue = json.loads(losses.CATALOGUE_FILE.read_text())
    for change, match in [
        (lambda c: c["losses"]["gspo"]["datum_rules"].append({"all_positive": "advantages", "message": "x"}), "datum rule this engine does not know"),
        (lambda c: c["losses"]["ppo"]["config"]["clip_high_threshold"].update(below=10), "fields this engine does not know"),
    ]:
        copy = json.loads(json.dumps(catalogue))
        change(copy)
        (tmp_path / "c.json").write_text(json.dumps(copy))
        with pytest.raises(RuntimeError, match=match):
            losses.load_catalogue(tmp_path / "c.json")


@pytest.mark.parametrize("x, text", [(-1.0, "-1"), (0.8, "0.8"), (1e-7, "1e-7"), (2.5e-5, "0.000025"), (1e21, "1e+21"),
                                     (1e20, "100000000000000000000"), (float("inf"), "Infinity"), (-0.0, "0")])
def test_numbers_in_messages_are_written_as_the_api_writes_them(x: float, text: str) -> None:
    assert losses.js_number(x) == text
