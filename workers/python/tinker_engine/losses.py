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

Sources for each definition and default: docs/losses.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import UserError

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]
LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]
InputCheck = Callable[[Inputs, Config, str], None]

# Per-token loss inputs of SDK 0.38 (tinker/types/datum.py _KEY_TO_TYPE).
CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")
# stable_reinforce's server inputs (the catalogue's server_inputs): what the server recorded at
# sampling time, resolved by the API from the datum's provenance spans: ``stability_logprobs``, the
# sampler's logprob at each sampled target position (0 elsewhere), and ``stability_mask``, 1 at
# those positions, 0 elsewhere. Clients cannot send these names (the API refuses them).


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


def importance_sampling(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def _ppo_objective(ratio: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, _clip(ratio, inputs, config) * adv).sum()


def ppo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return _ppo_objective(_ratio(lp, inputs), inputs, config)


def cispo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weight = _clip(_ratio(lp, inputs), inputs, config).detach()
    return -(weight * lp * inputs["advantages"]).sum()


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


def gspo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    # Without a host sync (the mean as a masked sum over the count, the empty case by where).
    in_ratio = gspo_mask(inputs).to(torch.float32)
    count = in_ratio.sum()
    log_ratio = ((lp.detach() - inputs["logprobs"]) * in_ratio).sum() / count.clamp(min=1.0)
    ratio = torch.exp(log_ratio + lp - lp.detach())
    # No token in the ratio (only possible without an explicit mask and with every advantage 0): the loss is 0.
    return torch.where(count > 0, _ppo_objective(ratio, inputs, config), (lp * 0.0).sum())


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


# --- per-datum checks of the inputs beyond shapes and finiteness --------------------------------

def _check_clip(inputs: Inputs, config: Config, where: str) -> None:
    names = [n for n in CLIP_INPUTS if n in config or n in inputs]
    values = {n: inputs[n] if n in inputs else torch.tensor(config[n]) for n in names}
    for name, value in values.items():
        if name == "clip_high_threshold" and bool((value <= 0).any()):
            raise UserError(f"{where}: {name} must be > 0")
        if name == "clip_low_threshold" and bool((value < 0).any()):
            raise UserError(f"{where}: {name} must be >= 0")
    if len(values) == 2 and bool((values["clip_low_threshold"] > values["clip_high_threshold"]).any()):
        raise UserError(f"{where}: clip_low_threshold exceeds clip_high_threshold")


def _check_gspo(inputs: Inputs, config: Config, where: str) -> None:
    _check_clip(inputs, config, where)
    mask = inputs.get("sequence_ratio_mask")
    if mask is not None and not bool((mask != 0).any()):
        raise UserError(f"{where}: sequence_ratio_mask marks no token; the sequence ratio needs at least one")


def _check_stable_reinforce(inputs: Inputs, config: Config, where: str) -> None:
    _check_clip(inputs, config, where)
    outside = (inputs["stability_mask"] == 0) & (inputs["advantages"] != 0)
    if bool(outside.any()):
        pos = int(torch.nonzero(outside)[0][0])
        raise UserError(f"{where}: stable_reinforce takes nonzero advantages only on sampled tokens, "
                        f"but position {pos} is not a sampled token (its provenance is a prompt span) "
                        f"and has advantage {float(inputs['advantages'][pos])}")


@dataclass(frozen=True)
class LossSpec:
    """A loss function and what it needs from the request."""

    name: str
    fn: LossFn
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...]
    # Config keys with their defaults; None marks a required key.
    config: Mapping[str, float | None]
    # Whether (N, K) targets are allowed (top-K distillation); otherwise targets are (N,).
    allows_topk: bool
    # Checks of one datum's inputs against the config (per-token thresholds, masks).
    check: InputCheck | None = field(default=None)

    def parse_config(self, raw: Mapping[str, Any] | None) -> dict[str, float]:
        """Validate ``loss_fn_config`` against this loss: known keys, finite numbers, defaults."""
        raw = raw or {}
        unknown = sorted(set(raw) - set(self.config))
        if unknown:
            accepted = ", ".join(sorted(self.config)) or "none"
            raise UserError(f"loss_fn_config for '{self.name}' has unknown keys {unknown}; accepted: {accepted}")
        parsed: dict[str, float] = {}
        for key, default in self.config.items():
            value = raw.get(key)
            if value is None:
                if default is None:
                    raise UserError(f"loss '{self.name}' requires loss_fn_config['{key}']")
                parsed[key] = default
                continue
            try:
                number = float(value) if not isinstance(value, bool) else math.nan
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number):
                raise UserError(f"loss_fn_config['{key}'] must be a finite number, got {value!r}")
            parsed[key] = number
        if "clip_low_threshold" in parsed and parsed["clip_low_threshold"] > parsed["clip_high_threshold"]:
            raise UserError("loss_fn_config: clip_low_threshold must not exceed clip_high_threshold")
        if parsed.get("kl_coeff", 0.0) < 0:
            raise UserError(f"loss_fn_config['kl_coeff'] must be >= 0, got {parsed['kl_coeff']}")
        return parsed


# The loss catalogue (queues/contract/losses.json, read by the API too): each loss's inputs, config keys and
# defaults. The source of each default (docs/losses.md):
# - ppo 0.8 / 1.2: Tinker's PPO docs ("epsilon_low and epsilon_high ... currently fixed to 0.2").
# - cispo 0.0 / 4.0: Tinker's CISPO docs and cookbook tutorial 202 (one-sided clip by default,
#   following MiniMax-M1 and ScaleRL).
# - gspo 1 - 3e-4 / 1 + 4e-4: the GSPO paper's clipping ranges (arXiv 2507.18071, section 5.1);
#   Tinker's GSPO docs define the objective with 1 - eps_low / 1 + eps_high.
# - stable_reinforce kl_coeff 0.0 (the SDK names kl_coeff; a penalty is off unless asked for) and
#   clip_high_threshold 4.0 (the truncation of the detached importance weight, CISPO's default).
# The engine is run from the project's tree (workers/python), so the file is found beside it;
# TB_LOSS_CATALOGUE names another copy.
CATALOGUE_FILE = Path(os.environ.get("TB_LOSS_CATALOGUE") or Path(__file__).resolve().parents[3] / "queues/contract/losses.json")

# The functions of the catalogue's losses, by name.
_FUNCTIONS: dict[str, tuple[LossFn, InputCheck | None]] = {
    "cross_entropy": (cross_entropy, None),
    "importance_sampling": (importance_sampling, None),
    "ppo": (ppo, _check_clip),
    "cispo": (cispo, _check_clip),
    "dro": (dro, None),
    "gspo": (gspo, _check_gspo),
    "stable_reinforce": (stable_reinforce, _check_stable_reinforce),
}


def load_catalogue(path: Path = CATALOGUE_FILE) -> dict[str, LossSpec]:
    """The catalogue's losses with their functions; a loss without a function (or a function
    without a loss) is an error at import, so the engine and the API cannot drift apart."""
    entries = json.loads(path.read_text())["losses"]
    if set(entries) != set(_FUNCTIONS):
        raise RuntimeError(f"{path}: losses {sorted(entries)} but the engine implements {sorted(_FUNCTIONS)}")
    specs = {}
    for name, e in entries.items():
        fn, check = _FUNCTIONS[name]
        specs[name] = LossSpec(name, fn, tuple(e["inputs"]) + tuple(e["server_inputs"]), tuple(e["optional_inputs"]),
                               dict(e["config"]), allows_topk=bool(e["topk"]), check=check)
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
