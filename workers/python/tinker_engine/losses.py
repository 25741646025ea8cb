"""Loss functions of docs/engine-protocol.md, as pure functions of one datum.

Each function takes ``lp`` (log p(target_tokens) under the model, float32, shape of the targets),
the datum's float loss inputs and the parsed config, and returns the datum's loss: a 0-d tensor,
a **sum** over its tokens (never a mean). The batch loss is the sum over datums.

With ``r = exp(lp - q)`` (``q`` = sampler ``logprobs``, ``A`` = ``advantages``), ``lo``/``hi`` the clip
thresholds (per-token ``clip_low_threshold`` / ``clip_high_threshold`` inputs where the datum has
them, else ``loss_fn_config``) and ``sg`` a stop-gradient:

- ``cross_entropy``:       -sum(w * lp)                       (w = ``weights``, ones if absent; (N,K) allowed)
- ``importance_sampling``: -sum(r * A)                        (exact, no truncation)
- ``ppo``:                 -sum(min(r * A, clip(r, lo, hi) * A))
- ``cispo``:               -sum(sg(clip(r, lo, hi)) * lp * A)
- ``dro``:                 -sum(lp * A - 0.5 * beta * (lp - q)^2)
- ``gspo``:                ppo with every token's ratio s_t = exp(sg(mean_M(lp - q)) + lp - sg(lp)),
                           M = the tokens ``sequence_ratio_mask`` marks (GSPO-token)
- ``stable_reinforce``:    -sum_S(sg(min(r, hi)) * A * lp) + kl_coeff * sum_S(r - 1 - log r), with q the
                           sampler logprobs the server recorded and S the sampled positions
                           (our reconstruction; docs/losses.md says what is and is not public)

Sources for each definition and default: docs/losses.md. The rules of each loss (inputs, config
keys, defaults, bounds, checks of a datum's values) are data in the loss catalogue, which the API
reads too; ``LossSpec`` below checks them without naming any loss.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import torch

from .errors import UserError
from .settings import current as settings

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]
LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]

# The loss functions, by name: a function decorated with @loss_function is the loss of its name in the catalogue.
_FUNCTIONS: dict[str, LossFn] = {}


def loss_function(fn: LossFn) -> LossFn:
    _FUNCTIONS[fn.__name__] = fn
    return fn


# stable_reinforce's server inputs (the catalogue's server_inputs): what the server recorded at
# sampling time, resolved by the API from the datum's provenance spans: ``stability_logprobs``, the
# sampler's logprob at each sampled target position (0 elsewhere), and ``stability_mask``, 1 at
# those positions, 0 elsewhere. Clients cannot send these names (the API refuses them).


@loss_function
def cross_entropy(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weights = inputs.get("weights")
    if weights is None:
        return -lp.sum()
    return -(weights * lp).sum()


def _ratio(lp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])


def _threshold(inputs: Inputs, config: Config, name: str, like: torch.Tensor) -> torch.Tensor:
    """The datum's per-token threshold where it has one, else the config's value, shaped like ``like``."""
    per_token = inputs.get(name)
    if per_token is not None:
        return per_token
    return torch.full_like(like, config[name])


def _clip(ratio: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    lo = _threshold(inputs, config, "clip_low_threshold", ratio)
    hi = _threshold(inputs, config, "clip_high_threshold", ratio)
    return torch.clamp(ratio, min=lo.detach(), max=hi.detach())


@loss_function
def importance_sampling(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def _ppo_objective(ratio: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, _clip(ratio, inputs, config) * adv).sum()


@loss_function
def ppo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return _ppo_objective(_ratio(lp, inputs), inputs, config)


@loss_function
def cispo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weight = _clip(_ratio(lp, inputs), inputs, config).detach()
    return -(weight * lp * inputs["advantages"]).sum()


@loss_function
def dro(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    beta = config["beta"]
    penalty = 0.5 * beta * (lp - inputs["logprobs"]) ** 2
    return -(lp * inputs["advantages"] - penalty).sum()


def gspo_mask(inputs: Inputs) -> torch.Tensor:
    """The tokens of the sequence ratio: ``sequence_ratio_mask != 0``; without a mask, the tokens
    with a nonzero advantage (the only ones whose ratio enters the loss)."""
    mask = inputs.get("sequence_ratio_mask")
    if mask is None:
        mask = inputs["advantages"]
    return mask != 0


@loss_function
def gspo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    # Without a host sync (the mean as a masked sum over the count, the empty case by where).
    in_ratio = gspo_mask(inputs).to(torch.float32)
    count = in_ratio.sum()
    log_ratio = ((lp.detach() - inputs["logprobs"]) * in_ratio).sum() / count.clamp(min=1.0)
    ratio = torch.exp(log_ratio + lp - lp.detach())
    # No token in the ratio (only possible without an explicit mask and with every advantage 0): the loss is 0.
    return torch.where(count > 0, _ppo_objective(ratio, inputs, config), (lp * 0.0).sum())


@loss_function
def stable_reinforce(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    sampled = inputs["stability_mask"] != 0
    log_ratio = torch.where(sampled, lp - inputs["stability_logprobs"], torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    hi = _threshold(inputs, config, "clip_high_threshold", ratio).detach()
    weight = torch.minimum(ratio, hi).detach()
    adv = torch.where(sampled, inputs["advantages"], torch.zeros_like(lp))
    loss = -(weight * adv * lp).sum()
    kl_coeff = config["kl_coeff"]
    if kl_coeff != 0.0:
        # k3 = r - 1 - log r: an unbiased, nonnegative estimate of KL(sampler || model) on tokens
        # drawn from the sampler, whose gradient (r - 1) * grad(lp) is unbiased too.
        k3 = torch.where(sampled, ratio - 1.0 - log_ratio, torch.zeros_like(lp))
        loss = loss + kl_coeff * k3.sum()
    return loss


# --- the rules: read from the catalogue, checked by one generic checker ----------------------------

# The loss catalogue (queues/contract/losses.json), read by the API too: each loss's inputs, config
# keys with their defaults and bounds, and the checks of a datum's values. Its $comment says what
# each field means; docs/losses.md gives the source of every default. The engine is run from the
# project's tree (workers/python), so the file is found beside it; the settings may name another copy.
CATALOGUE_FILE = Path(settings().loss_catalogue or Path(__file__).resolve().parents[3] / "queues/contract/losses.json")


def _read_catalogue(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# A loss_fn_config value written as text: the catalogue's pattern, matched in full.
NUMBER_TEXT = re.compile(_read_catalogue(CATALOGUE_FILE)["config_number_text"])


def js_number(x: float) -> str:
    """``x`` as JavaScript's String(x) writes it, so that the engine's messages are the API's."""
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0:
        return "0"
    if 1e-6 <= abs(x) < 1e21:
        text = format(Decimal(repr(x)), "f")
        return text[:-2] if text.endswith(".0") else text
    mantissa, exponent = repr(x).split("e")
    return f"{mantissa}e{'+' if int(exponent) >= 0 else '-'}{abs(int(exponent))}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: Any) -> float:
    """A config value as a float: a number, or text matching the catalogue's pattern; else NaN."""
    try:
        if _is_number(value):
            return float(value)
        if isinstance(value, str) and NUMBER_TEXT.fullmatch(value):
            return float(value)
    except OverflowError:  # an int past float's range
        return math.copysign(math.inf, value)
    return math.nan


def _got(value: Any, number: float) -> str:
    """The refused value as the API's message writes it."""
    if isinstance(value, str):
        return f"'{value}'"
    return js_number(number) if _is_number(value) else repr(value)


def _broken_bound(bounds: Mapping[str, float], value: torch.Tensor) -> str | None:
    """The bound ``value`` breaks somewhere, as the message says it (``>= 0``), or None."""
    if "at_least" in bounds and bool((value < bounds["at_least"]).any()):
        return f">= {js_number(bounds['at_least'])}"
    if "above" in bounds and bool((value <= bounds["above"]).any()):
        return f"> {js_number(bounds['above'])}"
    return None


@dataclass(frozen=True)
class LossSpec:
    """A loss function and its rules from the catalogue."""

    name: str
    fn: LossFn
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...]
    # Config keys with their defaults; None marks a required key.
    config: Mapping[str, float | None]
    # Whether (N, K) targets are allowed (top-K distillation); otherwise targets are (N,).
    allows_topk: bool
    # Config keys' bounds ({"at_least": 0} or {"above": 0}), pairs [a, b] with a <= b, datum rules.
    bounds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    ordered: tuple[tuple[str, str], ...] = ()
    datum_rules: tuple[Mapping[str, str], ...] = ()

    def _per_token(self, key: str) -> bool:
        """Whether a datum may replace the config key with its own per-token values."""
        return key in self.optional_inputs

    def parse_config(self, raw: Mapping[str, Any] | None) -> dict[str, float]:
        """``loss_fn_config`` checked against this loss (known keys, finite numbers, bounds of the keys
        a datum cannot replace, ordered pairs), with the defaults applied."""
        raw = raw or {}
        unknown = sorted(set(raw) - set(self.config))
        if unknown:
            accepted = ", ".join(sorted(self.config)) or "none"
            named = ", ".join(f"'{k[:64]}'" for k in unknown[:10]) + (f", … ({len(unknown)} in all)" if len(unknown) > 10 else "")
            raise UserError(f"loss_fn_config for '{self.name}' has unknown keys [{named}]; accepted: {accepted}")
        parsed: dict[str, float] = {}
        for key, default in self.config.items():
            value = raw.get(key)
            if value is None:
                if default is None:
                    raise UserError(f"loss '{self.name}' requires loss_fn_config['{key}']")
                parsed[key] = default
                continue
            number = _number(value)
            if not math.isfinite(number):
                raise UserError(f"loss_fn_config['{key}'] must be a finite number, got {_got(value, number)}")
            parsed[key] = number
        for key, bounds in self.bounds.items():
            broken = None if self._per_token(key) else _broken_bound(bounds, torch.tensor(parsed[key], dtype=torch.float64))
            if broken:
                raise UserError(f"loss_fn_config['{key}'] must be {broken}, got {js_number(parsed[key])}")
        for a, b in self.ordered:
            if parsed[a] > parsed[b]:
                raise UserError(f"loss_fn_config: {a} must not exceed {b}")
        return parsed

    def check(self, inputs: Inputs, config: Config, where: str) -> None:
        """One datum's input values against the parsed config: the bounds and ordered pairs of the keys
        it may give per token (on the values it uses: its own, else the config's), then the datum rules."""

        def used(key: str) -> torch.Tensor:
            return inputs[key] if key in inputs else torch.tensor(config[key], dtype=torch.float64)

        for key, bounds in self.bounds.items():
            broken = _broken_bound(bounds, used(key)) if self._per_token(key) else None
            if broken:
                raise UserError(f"{where}: {key} must be {broken}")
        for a, b in self.ordered:
            if (self._per_token(a) or self._per_token(b)) and bool((used(a) > used(b)).any()):
                raise UserError(f"{where}: {a} exceeds {b}")
        for rule in self.datum_rules:
            if "some_nonzero" in rule:
                values = inputs.get(rule["some_nonzero"])
                if values is not None and not bool((values != 0).any()):
                    raise UserError(f"{where}: {rule['message']}")
                continue
            values, mask = inputs.get(rule["zero_outside"]), inputs.get(rule["mask"])
            if values is None or mask is None:
                continue
            outside = (values != 0) & (mask == 0)
            if bool(outside.any()):
                at = tuple(torch.nonzero(outside)[0].tolist())
                message = rule["message"].replace("{position}", str(at[0])).replace("{value}", js_number(float(values[at])))
                raise UserError(f"{where}: {message}")


_DATUM_RULES = ("some_nonzero", "zero_outside")


def load_catalogue(path: Path = CATALOGUE_FILE) -> dict[str, LossSpec]:
    """The catalogue's losses with their functions and rules; a loss without a function (or a function
    without a loss), or a rule this checker does not know, is an error at import, so the engine and
    the API cannot drift apart."""
    entries = _read_catalogue(path)["losses"]
    if set(entries) != set(_FUNCTIONS):
        raise RuntimeError(f"{path}: losses {sorted(entries)} but the engine implements {sorted(_FUNCTIONS)}")
    specs = {}
    for name, e in entries.items():
        for key, c in e["config"].items():
            if not set(c) <= {"default", "at_least", "above"}:
                raise RuntimeError(f"{path}: {name}'s config key {key} has fields this engine does not know: {sorted(c)}")
        for rule in e["datum_rules"]:
            if sum(kind in rule for kind in _DATUM_RULES) != 1:
                raise RuntimeError(f"{path}: {name} has a datum rule this engine does not know: {rule}")
        config = {key: c["default"] for key, c in e["config"].items()}
        bounds = {key: {b: c[b] for b in ("at_least", "above") if b in c} for key, c in e["config"].items()}
        specs[name] = LossSpec(name, _FUNCTIONS[name], tuple(e["inputs"]) + tuple(e["server_inputs"]),
                               tuple(e["optional_inputs"]), config, allows_topk=bool(e["topk"]),
                               bounds={k: b for k, b in bounds.items() if b},
                               ordered=tuple((a, b) for a, b in e["ordered"]), datum_rules=tuple(e["datum_rules"]))
    return specs


LOSSES: dict[str, LossSpec] = load_catalogue()


def get_loss(name: str) -> LossSpec:
    spec = LOSSES.get(name)
    if spec is None:
        raise UserError(f"unknown loss_fn '{name}'; supported: {', '.join(LOSSES)}")
    return spec


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) from ``logits`` (N, V): float32 log-softmax, gathered at ``targets`` (N,) or (N, K)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if targets.dim() == 1:
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp.gather(-1, targets)
