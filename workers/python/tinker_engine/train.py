"""``forward_backward`` and ``optim_step``.

forward_backward validates every datum before it touches the model, so a ``UserError`` changes
nothing. Datums are grouped into micro-batches of at most ``max_batch_tokens`` tokens
(``TB_ENGINE_MAX_BATCH_TOKENS``, settings.py), packed into one row each or padded (packing.py,
``TB_ENGINE_LAYOUT``); target logprobs come from the last hidden state through the output layer a
chunk of tokens at a time (chunked_logprobs.py); each micro-batch's summed loss is backpropagated
into the adapter's ``.grad``, which accumulates across calls until ``optim_step``. If anything
fails midway, the gradients are restored to what they were before the call; when that is the device
running out of memory, the op runs again with the micro-batch bound halved (``_fit_smaller``), down to
the longest datum, and the bound that fit stays for the base model's later ops.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from .chunked_logprobs import head_target_logprobs, plain_linear_head
from .errors import UserError
from .logprobs import target_logprobs
from .losses import LossSpec, get_loss
from .models import BaseModel, Registry
from .packing import Layout, Staged, attention_for, resolve, stage_all
from .params import check_token_tensor, get_bool, get_obj, get_str, is_int
from .protocol import defaults
from .rollback import StepUndo, check_grad_max_abs, check_losses, check_norm, grad_max_abs, step_max_abs
from .settings import current as settings
from .tensors import tensor_from_json, wire


log = logging.getLogger("tinker_engine")


def max_batch_tokens(base: BaseModel | None = None) -> int:
    """The most tokens of one micro-batch: the engine's setting (real tokens when packed, padded ones
    when padded), or less on ``base`` once a forward_backward on it ran out of device memory."""
    limit = settings().max_batch_tokens
    fit = base.fit_tokens if base is not None else None
    return min(limit, fit) if fit else limit


@dataclass
class Datum:
    """One validated datum: model input tokens, targets and float loss inputs (CPU tensors)."""

    index: int
    tokens: torch.Tensor  # (N,) int64
    targets: torch.Tensor  # (N,) or (N, K) int64
    inputs: dict[str, torch.Tensor]  # float32, each shaped like targets


def parse_datum(index: int, raw: Any, base: BaseModel, loss: LossSpec, config: dict[str, float]) -> Datum:
    where = f"datum {index}"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: must be an object with tokens and loss_fn_inputs")
    tokens = _datum_tokens(raw.get("tokens"), where)
    n = int(tokens.shape[0])
    if base.max_context_length and n > base.max_context_length:
        raise UserError(f"{where}: {n} tokens exceed the model's context length {base.max_context_length}")
    check_token_tensor(tokens, base.input_vocab_size, f"{where} tokens")

    raw_inputs = raw.get("loss_fn_inputs")
    if not isinstance(raw_inputs, dict):
        raise UserError(f"{where}: loss_fn_inputs must be an object")
    if "target_tokens" not in raw_inputs:
        raise UserError(f"{where}: loss_fn_inputs['target_tokens'] is required")
    targets = tensor_from_json(raw_inputs["target_tokens"], f"{where} target_tokens")
    if targets.dtype != torch.int64:
        raise UserError(f"{where}: target_tokens must be int64, got {targets.dtype}")
    allowed_dims = (1, 2) if loss.allows_topk else (1,)
    if targets.dim() not in allowed_dims:
        shape_text = "(N,) or (N, K)" if loss.allows_topk else "(N,)"
        raise UserError(f"{where}: target_tokens for '{loss.name}' must have shape {shape_text}, "
                        f"got {list(targets.shape)}")
    if targets.shape[0] != n or (targets.dim() == 2 and targets.shape[1] == 0):
        raise UserError(f"{where}: target_tokens has shape {list(targets.shape)} but the datum has {n} tokens; "
                        f"its first dimension must equal the token count")
    bad = (targets < 0) | (targets >= base.vocab_size)
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise UserError(f"{where}: target token id {value} is outside the vocabulary [0, {base.vocab_size})")

    for name in loss.required_inputs:
        if name not in raw_inputs:
            raise UserError(f"{where}: loss '{loss.name}' requires loss_fn_inputs['{name}']")
    inputs: dict[str, torch.Tensor] = {}
    for name in loss.required_inputs + loss.optional_inputs:
        if name not in raw_inputs:
            continue
        value = tensor_from_json(raw_inputs[name], f"{where} {name}").to(torch.float32)
        if value.shape != targets.shape:
            raise UserError(f"{where}: {name} has shape {list(value.shape)} but target_tokens has shape "
                            f"{list(targets.shape)}; they must match")
        if not bool(torch.isfinite(value).all()):
            raise UserError(f"{where}: {name} contains NaN or infinite values")
        inputs[name] = value
    if loss.check is not None:
        loss.check(inputs, config, where)
    return Datum(index=index, tokens=tokens, targets=targets, inputs=inputs)


def _datum_tokens(raw: Any, where: str) -> torch.Tensor:
    """A datum's tokens: an int tensor of shape (N,) (binary, or inline JSON) or a JSON list of integers."""
    if isinstance(raw, dict):
        raw = tensor_from_json(raw, f"{where} tokens")
    if isinstance(raw, torch.Tensor):
        if raw.dtype != torch.int64 or raw.dim() != 1 or raw.shape[0] == 0:
            raise UserError(f"{where}: tokens must be a non-empty int64 tensor of shape (N,), "
                            f"got {raw.dtype} {list(raw.shape)}")
        return raw
    if not isinstance(raw, list) or not raw or not all(is_int(t) for t in raw):
        raise UserError(f"{where}: tokens must be a non-empty list of integers")
    return torch.tensor(raw, dtype=torch.int64)


def layout(base: BaseModel, datums: list[Datum] | None = None) -> Layout:
    """How micro-batches of ``datums`` are formed and staged on ``base`` (packing.py): ``TB_ENGINE_LAYOUT``
    (``auto``: packed where the kernel is variable-length and padding them would cost enough)."""
    return resolve(settings().layout, base, datums, max_batch_tokens(base))


def stage(datums: list[Datum], base: BaseModel, how: Layout | None = None) -> list[Staged]:
    """Every micro-batch of ``datums`` in layout ``how`` (default: the engine's for them), staged on ``base``'s device."""
    return stage_all(datums, how or layout(base, datums), max_batch_tokens(base), base.device)


def _run_batch(base: BaseModel, staged: Staged, loss: LossSpec, config: dict[str, float],
               flat_weight: torch.nn.Parameter | None) -> tuple[list[torch.Tensor], float]:
    """Forward (and, given the adapter's ``flat_weight``, backward) of one staged micro-batch.

    The loss, the logprobs and the gradient's finiteness reach the host in one copy after the
    backward, so the GPU runs forward and backward without waiting for the host. A non-finite loss
    or gradient raises a ``UserError`` afterwards; ``forward_backward`` then restores the gradients
    it had before the op, so nothing of the micro-batch stays.
    """
    batch = staged.batch
    with torch.set_grad_enabled(flat_weight is not None):
        lps = batch_logprobs(base, staged)
        losses = [loss.fn(lp, inputs, config) for lp, inputs in zip(lps, staged.inputs)]
        stacked = torch.stack(losses)
        total = stacked.sum()
        checks = [total.detach().reshape(1).float(), stacked.detach().float()]
        if flat_weight is not None:
            total.backward()
            checks.append(grad_max_abs([flat_weight]).reshape(1).float())
        # One device -> host copy for the micro-batch: the total, every datum's loss, the gradient's
        # max-abs (NaN or infinite when any gradient element is), the logprobs.
        host = torch.cat([*checks, *(lp.detach().reshape(-1) for lp in lps)]).cpu()
    outputs: list[torch.Tensor] = []
    at = 1 + len(batch) + (1 if flat_weight is not None else 0)
    for d in batch:
        n = d.targets.numel()
        outputs.append(host[at : at + n].reshape(d.targets.shape))
        at += n
    indices = [d.index for d in batch]
    check_losses(indices, list(host[1 : 1 + len(batch)]), outputs)
    if flat_weight is not None:
        check_grad_max_abs(indices, float(host[1 + len(batch)]))
    return outputs, float(host[0])


def batch_logprobs(base: BaseModel, staged: Staged) -> list[torch.Tensor]:
    """Each datum's target logprobs (float32, shaped like its targets) for one staged micro-batch, in
    the current grad mode, through the active adapter(s).

    The decoder's last hidden state goes through the output layer a chunk of tokens at a time
    (chunked_logprobs.py), so the micro-batch's (tokens x vocab) logits never exist at once. A padded
    micro-batch runs mask-free: rows are right-padded and attention is causal, so no real token can
    see a pad, and pad positions' outputs are discarded here (each datum's logprobs are read at its slot). A packed one passes its restarting
    position ids (packing.py).
    """
    batch = staged.batch
    if not plain_linear_head(base.hf):
        # A model whose logits are more than its output layer (soft-capping, scaling): its own forward.
        with attention_for(base, staged) as extra:
            logits = base.hf(input_ids=staged.ids, position_ids=staged.position_ids, use_cache=False, **extra).logits
        flat_logits = logits.reshape(-1, logits.shape[-1])
        if isinstance(staged.targets, list):
            return [target_logprobs(flat_logits[a : a + d.tokens.shape[0]], t)
                    for (a, _), d, t in zip(staged.slots, batch, staged.targets)]
        lp = target_logprobs(flat_logits, staged.targets)
        return [lp[a : a + d.tokens.shape[0]] for (a, _), d in zip(staged.slots, batch)]
    with attention_for(base, staged) as extra:
        hidden = base.hf.get_decoder()(input_ids=staged.ids, position_ids=staged.position_ids,
                                       use_cache=False, **extra).last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1])
    head = base.hf.get_output_embeddings()
    if isinstance(staged.targets, list):
        return [head_target_logprobs(flat[a : a + d.tokens.shape[0]], head, t, offset=a)
                for (a, _), d, t in zip(staged.slots, batch, staged.targets)]
    # Padded: every position through the output layer (as the padded layout computes every position
    # anyway); a pad's target is 0 and its logprob unused, so its gradient is 0.
    lp = head_target_logprobs(flat, head, staged.targets)
    return [lp[a : a + d.tokens.shape[0]] for (a, _), d in zip(staged.slots, batch)]


@dataclass(frozen=True)
class ForwardBackwardRequest:
    """A parsed ``forward``/``forward_backward`` request, shared by every engine."""

    loss: LossSpec
    config: dict[str, float]
    forward_only: bool
    datums: list[Datum]


def parse_forward_backward(args: dict[str, Any], base: Any) -> ForwardBackwardRequest:
    """Loss, its config, the forward-only flag and every datum, checked against ``base``'s bounds."""
    loss = get_loss(get_str(args, "loss_fn"))
    raw_config = args.get("loss_fn_config")
    if raw_config is not None and not isinstance(raw_config, dict):
        raise UserError("loss_fn_config must be an object")
    config = loss.parse_config(raw_config)
    forward_only = get_bool(args, "forward_only", default=False)
    raw_data = args.get("data")
    if not isinstance(raw_data, list):
        raise UserError("data must be a list of datums")
    datums = [parse_datum(i, d, base, loss, config) for i, d in enumerate(raw_data)]
    return ForwardBackwardRequest(loss, config, forward_only, datums)


def forward_backward(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    model = registry.model(get_str(args, "model_id"))
    base = model.base
    req = parse_forward_backward(args, base)
    loss, config, forward_only, datums = req.loss, req.config, req.forward_only, req.datums

    base.activate(model.adapter, trainable=True)
    flat = model.flat
    saved = None if forward_only else flat.grads_saved()
    while True:
        outputs: list[torch.Tensor] = []
        total = 0.0
        try:
            for staged in stage(datums, base):
                batch_outputs, batch_loss = _run_batch(base, staged, loss, config, None if forward_only else flat.weight)
                outputs.extend(batch_outputs)
                total += batch_loss
            break
        except torch.OutOfMemoryError:
            if not forward_only:
                flat.restore_grads(saved)
        except BaseException:
            if not forward_only:
                flat.restore_grads(saved)
            raise
        # Out of device memory (outside the handler: the failed micro-batch's tensors are freed now).
        _fit_smaller(base, datums)
    if not forward_only:
        flat.pending = True
    return {
        "loss_fn_outputs": [{"logprobs": wire(lp)} for lp in outputs],
        "metrics": {"loss:sum": total},
    }


def _fit_smaller(base: BaseModel, datums: list[Datum]) -> None:
    """After a forward_backward ran out of device memory (its gradients already restored): halves the
    micro-batch bound of ``base`` for this op's retry and every later op, or re-raises when a single
    datum would no longer fit in a micro-batch. The retried op's result is the one it would have had
    with the smaller bound from the start (other micro-batches: another blocking of the same sums)."""
    current = max_batch_tokens(base)
    smaller = current // 2
    longest = max(len(d.tokens) for d in datums)
    if base.device.type == "cuda":
        torch.cuda.empty_cache()
    if smaller < longest:
        raise torch.OutOfMemoryError(
            f"forward_backward ran out of device memory with micro-batches of at most {current} tokens, and "
            f"cannot split them further: a datum has {longest} tokens (send shorter datums, or give this engine "
            f"more of the GPU: TB_GPU_MEMORY)")
    base.fit_tokens = smaller
    log.warning("forward_backward ran out of device memory with micro-batches of at most %d tokens; "
                "retrying with %d, kept for base %s (TB_ENGINE_MAX_BATCH_TOKENS=%d)",
                current, smaller, base.name, settings().max_batch_tokens)


#: Tinker's AdamParams defaults (queues/contract/params.ts, read from protocol.json), for in-process callers.
ADAM_DEFAULTS = defaults("optim_step", "adam")


@dataclass(frozen=True)
class AdamParams:
    """The ``adam`` object of ``optim_step``. Its fields, bounds and defaults are declared once, in
    queues/contract/params.ts. The engine checks every request's args against protocol.json before
    the op runs, so ``parse`` only converts; a field an in-process caller leaves out takes its default."""

    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float  # decoupled (AdamW)
    grad_clip_norm: float  # 0: no clipping

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> AdamParams:
        p = {**ADAM_DEFAULTS, **obj}
        return cls(**{f.name: float(p[f.name]) for f in fields(cls)})


def optim_step(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    model = registry.model(get_str(args, "model_id"))
    hp = AdamParams.parse(get_obj(args, "adam"))
    flat = model.flat
    if model.optimizer is None:
        model.optimizer = flat.optimizer(hp.learning_rate, (hp.beta1, hp.beta2), hp.eps, hp.weight_decay)
    opt = model.optimizer
    for group in opt.param_groups:
        group["lr"] = hp.learning_rate
        group["betas"] = (hp.beta1, hp.beta2)
        group["eps"] = hp.eps
        group["weight_decay"] = hp.weight_decay
    if not flat.pending:
        # No gradient since the last step: nothing moves (no weight decay, no step count).
        return {"metrics": {"grad_norm": 0.0, "learning_rate": hp.learning_rate}}
    # The adapter is one flat parameter (flat.py): the norm, the step, the snapshot and the check
    # below are each one op on one tensor.
    params = [flat.weight]
    undo = StepUndo(params, opt, model.undo_buffers, grads_change=hp.grad_clip_norm > 0)
    if hp.grad_clip_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, hp.grad_clip_norm)
    else:
        norm = torch.nn.utils.get_total_norm([flat.grad])
    try:
        opt.step()
        # One host copy after the step (not one before it and one after): the gradient norm and the
        # step's max-abs; either non-finite undoes the step.
        norm_value, step_max = torch.stack([norm.detach().float().reshape(()).to(params[0].device),
                                            step_max_abs(params, opt).float()]).tolist()
        check_norm(norm_value)
        if not math.isfinite(step_max):
            raise UserError("optim_step: the step would make a weight or an AdamW moment non-finite "
                            f"(learning_rate {hp.learning_rate}); nothing was applied")
    except BaseException as exc:
        undo.restore(opt)
        if isinstance(exc, RuntimeError) and "overflow" in str(exc):
            raise UserError(f"optim_step: the step overflows float32 (learning_rate {hp.learning_rate}): {exc}; "
                            "nothing was applied") from exc
        raise
    flat.zero_grad()
    return {"metrics": {"grad_norm": norm_value, "learning_rate": hp.learning_rate}}

