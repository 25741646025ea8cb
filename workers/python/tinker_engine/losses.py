"""Loss functions of docs/engine-protocol.md, as pure functions of one datum.

Each function takes ``lp`` (log p(target_tokens) under the model, float32, shape of the targets),
the datum's float loss inputs and the parsed config, and returns the datum's loss: a 0-d tensor,
a **sum** over its tokens (never a mean). The batch loss is the sum over datums.

With ``r = exp(lp - q)`` (``q`` = sampler ``logprobs``, ``A`` = ``advantages``):

- ``cross_entropy``:       -sum(w * lp)                       (w = ``weights``, ones if absent; (N,K) allowed)
- ``importance_sampling``: -sum(r * A)                        (exact, no truncation)
- ``ppo``:                 -sum(min(r * A, clip(r, lo, hi) * A))
- ``cispo``:               -sum(sg(clip(r, lo, hi)) * lp * A)  (sg = stop-gradient)
- ``dro``:                 -sum(lp * A - 0.5 * beta * (lp - q)^2)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UserError

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]
LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]


def cross_entropy(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weights = inputs.get("weights")
    if weights is None:
        return -lp.sum()
    return -(weights * lp).sum()


def _ratio(lp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])


def importance_sampling(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = _ratio(lp, inputs)
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def cispo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = _ratio(lp, inputs)
    weight = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(weight * lp * inputs["advantages"]).sum()


def dro(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    beta = config["beta"]
    penalty = 0.5 * beta * (lp - inputs["logprobs"]) ** 2
    return -(lp * inputs["advantages"] - penalty).sum()


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
        return parsed


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_RL_INPUTS = ("logprobs", "advantages")

LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", cross_entropy, (), ("weights",), {}, allows_topk=True),
        LossSpec("importance_sampling", importance_sampling, _RL_INPUTS, (), {}, allows_topk=False),
        LossSpec("ppo", ppo, _RL_INPUTS, (), _CLIP, allows_topk=False),
        LossSpec("cispo", cispo, _RL_INPUTS, (), _CLIP, allows_topk=False),
        LossSpec("dro", dro, _RL_INPUTS, (), {"beta": None}, allows_topk=False),
    )
}


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
