"""``save_state`` / ``load_state``: training checkpoints (LoRA weights, optionally AdamW state).

A checkpoint directory holds:

- ``adapter_config.json`` + ``adapter_model.safetensors``: exactly what ``save_sampler`` writes, so
  the directory is also a standard PEFT adapter (``PeftModel.from_pretrained(base, dir)``, vLLM).
- ``tinker_state.json``: ``{"format": 1, "base_model": <base name>, "lora": {"rank", "seed",
  "train_unembed", "train_mlp", "train_attn"}, "has_optimizer": bool}``.
- with the optimizer: ``optimizer.safetensors`` (``exp_avg/<key>`` and ``exp_avg_sq/<key>`` per
  parameter that has Adam state) and ``optimizer.json`` (``{"format": 1, "optimizer": "adamw",
  "hyperparameters": {"lr", "betas", "eps", "weight_decay"} | null, "step": {<key>: number}}``).

``<key>`` is the PEFT state-dict name of a LoRA matrix (``base_model.model.<module>.lora_A.weight``),
the same key as in ``adapter_model.safetensors``: it does not contain the engine's adapter name, so
a checkpoint of one ``model_id`` loads into another. Accumulated gradients are saved only when asked
(``gradients: true``, the agent's drain: ``gradients.safetensors``, by the same keys) and loaded only
when asked; a client's checkpoint never holds them.

``save_state`` writes everything into ``<dir>.tmp-<random>`` (files fsynced) and renames it to
``dir``, so a crash never leaves a partial checkpoint at ``dir``; ``dir`` must not exist yet.
``load_state`` reads and validates the whole checkpoint (config, keys, shapes, optimizer state)
before it changes the model, so every error leaves weights, gradients and optimizer untouched.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import UserError
from .flat import MOMENTS  # re-exported: the AdamW moments a checkpoint holds (the verl engine reads it here)
from .models import ADAPTER_FILES, Registry, TrainingModel
from .params import get_bool, get_str
from .rollback import device_copies
from .save import capture_adapter, write_captured_adapter

STATE_FORMAT = 1
STATE_FILE = "tinker_state.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
GRADIENTS = "gradients.safetensors"
LORA_FIELDS = ("rank", "train_unembed", "train_mlp", "train_attn")  # must match to load


def peft_key(model: TrainingModel, name: str) -> str:
    """The adapter-name-free PEFT state-dict key of one of ``model.params``' names."""
    marker = f".{model.adapter}."
    if marker not in name:
        raise RuntimeError(f"parameter {name} does not belong to adapter {model.adapter}")
    return "base_model.model." + name.replace(marker, ".", 1)


def _keyed_params(model: TrainingModel) -> dict[str, torch.nn.Parameter]:
    return {peft_key(model, name): p for name, p in model.params}


def _lora_json(model: Any) -> dict[str, Any]:
    """A model's LoRA config as a checkpoint records it (any engine's model with a ``lora`` spec)."""
    lora = model.lora
    return {"rank": lora.rank, "seed": lora.seed, "train_unembed": lora.train_unembed,
            "train_mlp": lora.train_mlp, "train_attn": lora.train_attn}


def _describe_lora(lora: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={lora.get(k)!r}" for k in LORA_FIELDS) + "}"


# --- save -------------------------------------------------------------------------------------


def _optimizer_payload(model: TrainingModel, on_device: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The AdamW state as (tensors, json), per parameter as separate tensors would have it, copied
    (later steps do not change it) to CPU memory, or with ``on_device`` on the model's device; a
    model that never stepped gives an empty state."""
    tensors: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    hyper: dict[str, Any] | None = None
    opt = model.optimizer
    if opt is not None:
        if len(opt.param_groups) != 1:
            raise RuntimeError(f"expected one optimizer param group, found {len(opt.param_groups)}")
        group = opt.param_groups[0]
        hyper = {"lr": float(group["lr"]), "betas": [float(b) for b in group["betas"]],
                 "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}
        for key, st in zip(_keyed_params(model), model.flat.param_states(opt)):
            if not st:
                continue
            steps[key] = float(st["step"])
            for moment in MOMENTS:
                tensors[f"{moment}/{key}"] = st[moment] if on_device else st[moment].detach().to("cpu", torch.float32, copy=True).contiguous()
        if on_device:
            tensors = dict(zip(tensors, device_copies([t.float() for t in tensors.values()])))
    meta = {"format": STATE_FORMAT, "optimizer": "adamw", "hyperparameters": hyper, "step": steps}
    return tensors, meta


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _fsync_dir_tree(directory: str) -> None:
    for fname in os.listdir(directory):
        fd = os.open(os.path.join(directory, fname), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_path(directory)


def _fsync_path(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(fd)


def save_state_target(args: dict[str, Any]) -> tuple[str, bool]:
    """save_state's directory (absolute; refused when it exists) and whether the optimizer goes with it (every engine)."""
    path = os.path.normpath(os.path.abspath(get_str(args, "dir")))
    with_optimizer = get_bool(args, "optimizer")
    if os.path.lexists(path):
        raise UserError(f"save_state: {path} already exists (delete it first to overwrite)")
    return path, with_optimizer


@dataclass
class CapturedState:
    """A model's training state copied: what ``write_state`` puts on disk. Later training steps do
    not change it, so it can be written while the model trains on. Its tensors are in CPU memory,
    or (captured ``on_device``) on the model's device until ``host`` copies them."""

    adapter_config: Any
    adapter_tensors: dict[str, torch.Tensor]
    state_json: dict[str, Any]
    optimizer: tuple[dict[str, torch.Tensor], dict[str, Any]] | None
    gradients: dict[str, torch.Tensor] | None

    def host(self) -> CapturedState:
        """The same state with every tensor in CPU memory (contiguous, as ``save_file`` writes it)."""
        def cpu(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: t.to("cpu").contiguous() for k, t in ts.items()}
        optimizer = None if self.optimizer is None else (cpu(self.optimizer[0]), self.optimizer[1])
        gradients = None if self.gradients is None else cpu(self.gradients)
        return CapturedState(self.adapter_config, cpu(self.adapter_tensors), self.state_json, optimizer, gradients)


def capture_state(model: TrainingModel, with_optimizer: bool, gradients: bool = False, on_device: bool = False) -> CapturedState:
    """The model's state, copied (``on_device``: copies on its device, for a writer thread to move;
    not with ``gradients``)."""
    config, tensors = capture_adapter(model, on_device)
    optimizer = None
    if with_optimizer:
        optimizer = _optimizer_payload(model, on_device)
    grads = None
    if gradients:
        grads = {key: p.grad.detach().to("cpu", torch.float32, copy=True).contiguous()
                 for key, p in _keyed_params(model).items()} if model.flat.pending else {}
    state_json = {"format": STATE_FORMAT, "base_model": model.base.name, "lora": _lora_json(model),
                  "has_optimizer": with_optimizer}
    return CapturedState(config, tensors, state_json, optimizer, grads)


def write_state(captured: CapturedState, path: str) -> int:
    """Write a captured state as a checkpoint at ``path``, atomically: everything goes into
    ``<path>.tmp-<random>`` (files fsynced), which is renamed to ``path``. Returns its bytes.
    ``path`` must not exist."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{secrets.token_hex(6)}"
    os.mkdir(tmp)
    try:
        write_captured_adapter(captured.adapter_config, captured.adapter_tensors, tmp)
        if captured.optimizer is not None:
            tensors, meta = captured.optimizer
            save_file(tensors, os.path.join(tmp, OPTIMIZER_TENSORS), metadata={"format": "pt"})
            _write_json(os.path.join(tmp, OPTIMIZER_META), meta)
        if captured.gradients is not None:
            save_file(captured.gradients, os.path.join(tmp, GRADIENTS), metadata={"format": "pt"})
        _write_json(os.path.join(tmp, STATE_FILE), captured.state_json)
        size = sum(os.path.getsize(os.path.join(tmp, fname)) for fname in os.listdir(tmp))
        _fsync_dir_tree(tmp)
        if os.path.lexists(path):  # created meanwhile; os.rename would replace an empty directory
            raise UserError(f"save_state: {path} already exists (delete it first to overwrite)")
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_path(os.path.dirname(path))
    return size


def save_state(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    model = registry.model(get_str(args, "model_id"))
    path, with_optimizer = save_state_target(args)
    size = write_state(capture_state(model, with_optimizer, get_bool(args, "gradients", default=False)), path)
    return {"dir": get_str(args, "dir"), "size_bytes": size}


# --- load -------------------------------------------------------------------------------------


def _require_file(path: str) -> str:
    if not os.path.isfile(path):
        raise UserError(f"load_state: checkpoint file {path} is missing")
    return path


def _read_json(path: str) -> dict[str, Any]:
    _require_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"load_state: cannot read {path}: {exc}") from exc
    if not isinstance(obj, dict):
        raise UserError(f"load_state: {path} must hold a JSON object")
    return obj


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    _require_file(path)
    try:
        return load_file(path, device="cpu")
    except (OSError, SafetensorError) as exc:
        raise UserError(f"load_state: cannot read {path}: {exc}") from exc


def _check_tensor(path: str, key: str, tensor: torch.Tensor, param: torch.nn.Parameter) -> None:
    if tensor.shape != param.shape:
        raise UserError(f"load_state: {path}: '{key}' has shape {list(tensor.shape)}, the model's parameter "
                        f"has {list(param.shape)}")
    if not tensor.is_floating_point():
        raise UserError(f"load_state: {path}: '{key}' has dtype {tensor.dtype}, expected a float tensor")
    if not bool(torch.isfinite(tensor).all()):
        raise UserError(f"load_state: {path}: '{key}' contains NaN or infinite values")


def _read_weights(directory: str, keyed: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, "adapter_model.safetensors")
    tensors = _read_tensors(path)
    missing = sorted(set(keyed) - set(tensors))
    extra = sorted(set(tensors) - set(keyed))
    if missing or extra:
        raise UserError(f"load_state: {path} does not match the model's LoRA parameters "
                        f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                        f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''})")
    for key, p in keyed.items():
        _check_tensor(path, key, tensors[key], p)
    return tensors


def read_optimizer_files(directory: str, keyed: dict[str, Any], like: Callable[[Any], Any] = lambda p: p,
                         ) -> tuple[dict[str, Any] | None, dict[str, tuple[float, dict[str, torch.Tensor]]]]:
    """A saved AdamW state, checked against the parameters ``keyed`` (``like(p)`` gives what a saved
    moment must match): its hyperparameters (None when no parameter has state yet) and, per
    parameter with state, its step and moments. Shared by the torch and verl engines."""
    meta_path = os.path.join(directory, OPTIMIZER_META)
    tensor_path = os.path.join(directory, OPTIMIZER_TENSORS)
    meta = _read_json(meta_path)
    tensors = _read_tensors(tensor_path)
    if meta.get("format") != STATE_FORMAT or meta.get("optimizer") != "adamw":
        raise UserError(f"load_state: {meta_path} is not an AdamW state of format {STATE_FORMAT}")
    steps = meta.get("step")
    if not isinstance(steps, dict):
        raise UserError(f"load_state: {meta_path}: 'step' must be an object")
    unknown = sorted(set(steps) - set(keyed))
    if unknown:
        raise UserError(f"load_state: {meta_path}: state for parameters the model does not have: {unknown[:3]}")
    expected = {f"{m}/{k}" for k in steps for m in MOMENTS}
    if set(tensors) != expected:
        odd = sorted(set(tensors) ^ expected)
        raise UserError(f"load_state: {tensor_path} does not match the steps in {meta_path} (e.g. {odd[:3]})")
    if not steps:
        return None, {}
    raw = meta.get("hyperparameters")
    try:
        hyper = {"lr": float(raw["lr"]), "betas": [float(raw["betas"][0]), float(raw["betas"][1])],
                 "eps": float(raw["eps"]), "weight_decay": float(raw["weight_decay"])}
    except (TypeError, KeyError, IndexError, ValueError) as exc:
        raise UserError(f"load_state: {meta_path}: bad 'hyperparameters': {exc}") from exc
    entries: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    for key, step in steps.items():
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step < 0:
            raise UserError(f"load_state: {meta_path}: step of '{key}' must be a number >= 0, got {step!r}")
        for m in MOMENTS:
            _check_tensor(tensor_path, f"{m}/{key}", tensors[f"{m}/{key}"], like(keyed[key]))
        entries[key] = (float(step), {m: tensors[f"{m}/{key}"] for m in MOMENTS})
    return hyper, entries


def _read_optimizer(directory: str, model: TrainingModel,
                    keyed: dict[str, torch.nn.Parameter]) -> torch.optim.AdamW | None:
    """A new AdamW over ``model``'s flat adapter holding the saved state (None: the saved state is
    empty)."""
    hyper, entries = read_optimizer_files(directory, keyed)
    if hyper is None:
        return None
    return model.flat.optimizer(hyper["lr"], (hyper["betas"][0], hyper["betas"][1]), hyper["eps"],
                                hyper["weight_decay"], [entries.get(key) for key in keyed])


def check_state_dir(args: dict[str, Any], model: Any) -> tuple[str, bool, bool]:
    """A load_state request's checkpoint directory, checked against ``model`` before anything is read
    into it (any engine's model: ``model_id``, ``base.name``, ``lora``): format, base model, LoRA
    config, optimizer state when asked for, adapter files. Returns (path, with_optimizer, has_optimizer)."""
    directory = get_str(args, "dir")
    with_optimizer = get_bool(args, "optimizer")
    path = os.path.normpath(os.path.abspath(directory))
    if not os.path.isdir(path):
        raise UserError(f"load_state: checkpoint directory {path} does not exist")
    state_path = os.path.join(path, STATE_FILE)
    meta = _read_json(state_path)
    if meta.get("format") != STATE_FORMAT:
        raise UserError(f"load_state: {state_path}: unsupported format {meta.get('format')!r} "
                        f"(this engine reads {STATE_FORMAT})")
    if meta.get("base_model") != model.base.name:
        raise UserError(f"load_state: checkpoint {path} is of base model '{meta.get('base_model')}', "
                        f"but model '{model.model_id}' is on base model '{model.base.name}'")
    saved_lora = meta.get("lora")
    if not isinstance(saved_lora, dict):
        raise UserError(f"load_state: {state_path}: 'lora' must be an object")
    own_lora = _lora_json(model)
    if any(saved_lora.get(k) != own_lora[k] for k in LORA_FIELDS):
        raise UserError(f"load_state: checkpoint {path} has LoRA config {_describe_lora(saved_lora)}, but model "
                        f"'{model.model_id}' has {_describe_lora(own_lora)}; rank and targets must match")
    has_optimizer = meta.get("has_optimizer")
    if not isinstance(has_optimizer, bool):
        raise UserError(f"load_state: {state_path}: 'has_optimizer' must be a boolean")
    if with_optimizer and not has_optimizer:
        raise UserError(f"load_state: checkpoint {path} has no optimizer state (it was saved with optimizer=false)")
    for fname in ADAPTER_FILES:
        _require_file(os.path.join(path, fname))
    return path, with_optimizer, has_optimizer


def load_state(registry: Registry, args: dict[str, Any]) -> dict[str, Any]:
    model = registry.model(get_str(args, "model_id"))
    # Validate everything before touching the model.
    path, with_optimizer, has_optimizer = check_state_dir(args, model)
    keyed = _keyed_params(model)
    weights = _read_weights(path, keyed)
    optimizer = _read_optimizer(path, model, keyed) if with_optimizer else None
    grads: dict[str, torch.Tensor] = {}
    grads_path = os.path.join(path, GRADIENTS)
    if get_bool(args, "gradients", default=False) and os.path.isfile(grads_path):
        grads = _read_tensors(grads_path)
        for key, g in grads.items():
            if key not in keyed:
                raise UserError(f"load_state: {grads_path}: gradient for a parameter the model does not have: {key}")
            _check_tensor(grads_path, key, g, keyed[key])

    # Commit: nothing below raises for bad input.
    with torch.no_grad():
        for key, p in keyed.items():
            p.copy_(weights[key].to(device=p.device, dtype=p.dtype))
    model.flat.set_grads([grads.get(key) for key in keyed])
    model.optimizer = optimizer
    return {"model_id": model.model_id, "has_optimizer": has_optimizer}
