"""Base models and the LoRA adapters over them.

One ``BaseModel`` per ``load_base`` name: the transformers model is loaded once and frozen. All
adapters over it — one trainable adapter per ``model_id`` and the sampler adapters loaded from
``adapter_dir`` — are PEFT *named* adapters injected into that same module tree, so no base weight
is ever copied. ``BaseModel.activate`` selects which adapter (or none) the next forward uses.

LoRA choices: ``lora_alpha = rank`` (scaling 1, so the effective update is exactly B @ A),
dropout 0, no bias. Targets: ``train_attn`` -> q/k/v/o_proj, ``train_mlp`` -> gate/up/down_proj,
``train_unembed`` -> lm_head. Initialisation is deterministic and device-independent: walking the
adapter's parameters in name order, each ``lora_A`` is drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
(PEFT's default kaiming-uniform bound) with one CPU ``torch.Generator`` seeded with ``seed``, and
each ``lora_B`` is zero, so a fresh adapter leaves the base model's outputs unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import kernels
from .device import DTYPES, Placement
from .errors import UserError
from .params import get_bool, get_int, get_opt_int
from .flat import FlatAdapter
from .rollback import UndoBuffers
from .settings import current as settings

log = logging.getLogger("tinker_engine")

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class LoraSpec:
    """The ``lora`` object of ``create_model``."""

    rank: int
    seed: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> LoraSpec:
        seed = get_opt_int(obj, "seed", "lora")
        spec = cls(
            rank=get_int(obj, "rank", "lora", minimum=1),
            seed=0 if seed is None else seed,
            train_unembed=get_bool(obj, "train_unembed", "lora", default=True),
            train_mlp=get_bool(obj, "train_mlp", "lora", default=True),
            train_attn=get_bool(obj, "train_attn", "lora", default=True),
        )
        if not spec.target_modules():
            raise UserError("lora: at least one of train_attn, train_mlp, train_unembed must be true")
        return spec

    def target_modules(self) -> list[str]:
        targets: list[str] = []
        if self.train_attn:
            targets += ATTN_MODULES
        if self.train_mlp:
            targets += MLP_MODULES
        if self.train_unembed:
            targets += UNEMBED_MODULES
        return targets

    def peft_config(self, base_path: str) -> LoraConfig:
        return LoraConfig(
            task_type="CAUSAL_LM",
            r=self.rank,
            lora_alpha=self.rank,
            lora_dropout=0.0,
            bias="none",
            target_modules=self.target_modules(),
            base_model_name_or_path=base_path,
        )


def safe_adapter_name(prefix: str, key: str) -> str:
    """A PEFT adapter name (a module-dict key: no dots) unique for ``key``."""
    readable = re.sub(r"[^A-Za-z0-9_]", "_", key)[-32:]
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    return f"tb_{prefix}_{readable}_{digest}"


def seeded_lora_values(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> list[torch.Tensor]:
    """The deterministic LoRA init (see the module docstring) as float32 CPU tensors.

    ``shapes``: (name, full shape) of each LoRA matrix in name order; a name containing
    ``.lora_A.`` gets U(-1/sqrt(fan_in), 1/sqrt(fan_in)), any other zeros. Engines that shard
    parameters (verl) draw the full values here and copy their shard.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    values: list[torch.Tensor] = []
    for name, shape in shapes:
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(shape[1])
            values.append((torch.rand(shape, generator=gen, dtype=torch.float32) * 2.0 - 1.0) * bound)
        else:
            values.append(torch.zeros(shape, dtype=torch.float32))
    return values


def init_lora_weights(params: list[tuple[str, torch.nn.Parameter]], seed: int) -> None:
    """Deterministic LoRA init (see the module docstring); ``params`` in name order."""
    values = seeded_lora_values([(name, tuple(p.shape)) for name, p in params], seed)
    with torch.no_grad():
        for (_, p), value in zip(params, values):
            p.copy_(value.to(device=p.device, dtype=p.dtype))


class BaseModel:
    """A frozen causal LM with its tokenizer, loaded from a local directory."""

    def __init__(self, name: str, path: str, placement: Placement) -> None:
        self.name = name
        self.path = path
        self.placement = placement
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=placement.dtype, local_files_only=True)
        self.hf: PreTrainedModel = model.to(placement.device).eval()
        # Fused layers (TB_ENGINE_KERNELS), before any adapter wraps the projections.
        kernels.apply(settings(), self.hf)
        self.hf.requires_grad_(False)
        self.peft: PeftModel | None = None
        # (adapter, trainable) of the last ``activate``; None: unknown (PEFT changed it).
        self._active: tuple[str | None, bool] | None = None
        config = self.hf.config
        self.vocab_size: int = int(self.hf.get_output_embeddings().weight.shape[0])
        self.input_vocab_size: int = int(self.hf.get_input_embeddings().weight.shape[0])
        self.arch: str = (config.architectures or [config.model_type])[0]
        self.max_context_length: int = int(getattr(config, "max_position_embeddings", 0) or 0)
        # The forward's KV-cache argument: ``cache`` in newer transformers, ``past_key_values`` before.
        params = inspect.signature(self.hf.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        eos = self.tokenizer.eos_token_id
        self.eos_token_id: int | None = int(eos) if eos is not None else None
        # The micro-batch bound that fit the device's memory after a forward_backward ran out of it
        # (train.py: halved until it fits, kept for this base's later ops); None: the setting's.
        self.fit_tokens: int | None = None

    @property
    def device(self) -> torch.device:
        return self.placement.device

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "arch": self.arch,
            "max_context_length": self.max_context_length,
            "eos_token_id": self.eos_token_id,
        }

    def add_adapter(self, adapter: str, config: LoraConfig) -> None:
        self._active = None
        if self.peft is None:
            self.peft = get_peft_model(self.hf, config, adapter_name=adapter)
        else:
            self.peft.add_adapter(adapter, config)

    def load_adapter(self, adapter: str, directory: str) -> None:
        self._active = None
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.hf, directory, adapter_name=adapter, is_trainable=False)
        else:
            self.peft.load_adapter(directory, adapter_name=adapter, is_trainable=False)
        self.hf.eval()

    def delete_adapter(self, adapter: str) -> None:
        self._active = None
        if self.peft is not None and adapter in self.peft.peft_config:
            self.peft.delete_adapter(adapter)

    def activate(self, adapter: str | None, trainable: bool = False) -> None:
        """Make ``adapter`` the only active adapter (None: the frozen base model alone).

        Forward passes go through ``self.hf`` (the module tree PEFT injected into); with
        ``trainable`` only this adapter's parameters require grad. Repeating the last activation
        is free (it runs before every decode step).
        """
        if self._active == (adapter, trainable):
            return
        if self.peft is None:
            if adapter is not None:
                raise RuntimeError(f"adapter {adapter} is not loaded")
            return
        if adapter is None:
            self.peft.base_model.disable_adapter_layers()
            self._active = (adapter, trainable)
            return
        if adapter not in self.peft.peft_config:
            raise RuntimeError(f"adapter {adapter} is not loaded")
        self.peft.base_model.enable_adapter_layers()
        self.peft.set_adapter(adapter, inference_mode=not trainable)
        self._active = (adapter, trainable)

    def adapter_parameters(self, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
        """The adapter's LoRA parameters, in name order."""
        pattern = re.compile(rf"\.lora_[AB]\.{re.escape(adapter)}\.")
        return sorted(((n, p) for n, p in self.hf.named_parameters() if pattern.search(n)), key=lambda kv: kv[0])


@dataclass
class TrainingModel:
    """A trainable LoRA adapter (one ``model_id``) and its optimizer state.

    ``params`` are the adapter's LoRA parameters by name; their weights and gradients are views of
    ``flat``'s buffers, and ``optimizer`` (created by the first optim_step or a load) steps
    ``flat.weight`` (flat.py)."""

    model_id: str
    base: BaseModel
    adapter: str
    lora: LoraSpec
    params: list[tuple[str, torch.nn.Parameter]]
    flat: FlatAdapter
    optimizer: torch.optim.AdamW | None = None
    # optim_step's undo snapshot storage, reused from step to step (rollback.py).
    undo_buffers: UndoBuffers = field(default_factory=UndoBuffers)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.params]


@dataclass
class Registry:
    """All loaded base models, training adapters and cached sampler adapters of this engine."""

    placement: Placement
    sampler_cache_size: int = 4
    bases: dict[str, BaseModel] = field(default_factory=dict)
    models: dict[str, TrainingModel] = field(default_factory=dict)
    # Per base name: (adapter dir, mtime, size) key -> adapter name, least recently used first.
    samplers: dict[str, OrderedDict[str, str]] = field(default_factory=dict)
    # A training op ran since the CUDA caching allocator last released its free blocks.
    trained_since_release: bool = False
    # Sampler adapters in use by a generating batch (count per adapter name): never evicted.
    pinned: dict[str, int] = field(default_factory=dict)

    def pin(self, adapter: str) -> None:
        self.pinned[adapter] = self.pinned.get(adapter, 0) + 1

    def unpin(self, adapter: str) -> None:
        left = self.pinned.get(adapter, 0) - 1
        if left > 0:
            self.pinned[adapter] = left
        else:
            self.pinned.pop(adapter, None)

    def load_base(self, name: str, path: str, dtype: str | None = None) -> BaseModel:
        full = os.path.abspath(path)
        placement = self.placement
        if dtype is not None:
            if dtype not in DTYPES:
                raise UserError(f"load_base: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            placement = dataclasses.replace(placement, dtype=DTYPES[dtype])
        existing = self.bases.get(name)
        if existing is not None:
            if existing.path != full:
                raise UserError(f"base model '{name}' is already loaded from {existing.path}, not {full}")
            return existing
        if not os.path.isdir(full) or not os.path.isfile(os.path.join(full, "config.json")):
            raise UserError(f"load_base: {full} is not a model directory (no config.json)")
        base = BaseModel(name, full, placement)
        self.bases[name] = base
        self.samplers[name] = OrderedDict()
        return base

    def base(self, name: str) -> BaseModel:
        base = self.bases.get(name)
        if base is None:
            raise UserError(f"base model '{name}' is not loaded")
        return base

    def model(self, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            raise UserError(f"unknown model_id '{model_id}'")
        return model

    def create_model(self, model_id: str, base_name: str, lora: LoraSpec) -> TrainingModel:
        base = self.base(base_name)
        existing = self.models.get(model_id)
        if existing is not None:
            if existing.base is base and existing.lora == lora:
                return existing
            raise UserError(f"model_id '{model_id}' already exists with a different configuration")
        adapter = safe_adapter_name("m", model_id)
        base.add_adapter(adapter, lora.peft_config(base.path))
        params = base.adapter_parameters(adapter)
        if not params:
            base.delete_adapter(adapter)
            raise UserError(f"base model '{base_name}' has none of the LoRA target modules {lora.target_modules()}")
        for _, p in params:
            if p.dtype != torch.float32:
                p.data = p.data.float()
        init_lora_weights(params, lora.seed)
        model = TrainingModel(model_id=model_id, base=base, adapter=adapter, lora=lora, params=params,
                              flat=FlatAdapter([p for _, p in params]))
        self.models[model_id] = model
        return model

    def unload_model(self, model_id: str) -> bool:
        """Drop the adapter and its optimizer; False when ``model_id`` was not loaded."""
        model = self.models.pop(model_id, None)
        if model is None:
            return False
        model.base.delete_adapter(model.adapter)
        return True

    def sampler_adapter(self, base: BaseModel, adapter_dir: str) -> str:
        """The named adapter for a saved sampler directory, loading it on first use (LRU cache)."""
        directory = os.path.abspath(adapter_dir)
        for fname in ADAPTER_FILES:
            if not os.path.isfile(os.path.join(directory, fname)):
                raise UserError(f"adapter_dir {directory} is not a PEFT adapter directory (no {fname})")
        stat = Path(directory, "adapter_model.safetensors").stat()
        key = f"{directory}\0{stat.st_mtime_ns}\0{stat.st_size}"
        cache = self.samplers[base.name]
        adapter = cache.get(key)
        if adapter is not None:
            cache.move_to_end(key)
            return adapter
        adapter = safe_adapter_name("s", key)
        try:
            base.load_adapter(adapter, directory)
        except Exception:
            base.delete_adapter(adapter)
            raise
        cache[key] = adapter
        # Least recently used first; adapters a generating batch uses stay (the cache may overfill).
        for old_key in [k for k, name in cache.items() if name not in self.pinned and name != adapter]:
            if len(cache) <= self.sampler_cache_size:
                break
            evicted = cache.pop(old_key)
            base.delete_adapter(evicted)
            log.info("evicted sampler adapter %s", evicted)
        return adapter
