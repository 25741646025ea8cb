"""The verl engine's ops: protocol 2 training ops over verl 0.9's FSDP engine (``TinkerTrainingWorker``).

Every rank of the torchrun group runs every op with the same request (rank 0 reads it from the
channel and broadcasts it; see ``__main__``). Validation is deterministic, so a ``UserError`` is
raised on all ranks alike. Only rank 0's result is sent; only rank 0 writes files.

One ``TinkerTrainingWorker`` per ``model_id`` (the LoRA rank and targets are fixed when verl builds
the model): it loads the base model from its directory, wraps it with PEFT LoRA and FSDP2, and
builds AdamW. What the engine adds on top of verl: the seeded LoRA init of the torch engine, our
losses (``tinker_engine.losses`` via ``translate.make_loss_fn``), per-step AdamParams and grad
clipping, and checkpoints / sampler adapters in the torch engine's exact format.

Settings (settings.py, read once as the engine starts): the strategy (fsdp2 | fsdp | veomni, see
veomni.py), offload (parameters and optimizer state in CPU memory between ops, verl's
``param_offload``/``optimizer_offload``), gradient checkpointing, the attention implementation, and
a directory where small forward_backwards are recorded as JSON (the CI fixtures of
test_verl_translate.py). Padding removed or kept, gradient checkpointing and verl's
``max_token_len_per_gpu`` (at most the torch engine's ``max_batch_tokens``) are chosen per base model at
``load_base`` from its size and the GPU's memory, where the settings leave them to ``auto``, and logged
(levers.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tinker_engine import PROTOCOL_VERSION
from tinker_engine.engine import device_memory
from tinker_engine.errors import UserError
from tinker_engine.models import ADAPTER_FILES, LoraSpec, seeded_lora_values
from tinker_engine.params import get_obj, get_str
from tinker_engine.save import _normalise_config
from tinker_engine.state import (MOMENTS, OPTIMIZER_META, OPTIMIZER_TENSORS, STATE_FILE, STATE_FORMAT, _check_tensor,
                                 _fsync_dir_tree, _fsync_path, _lora_json, _read_tensors, _write_json,
                                 check_state_dir, read_optimizer_files, save_state_target)
from tinker_engine.tensors import tensor_to_json, wire
from tinker_engine.train import AdamParams, max_batch_tokens, parse_forward_backward

from tinker_engine import varlen

from . import compat, cpu, levers, translate, veomni
from .settings import current as settings

log = logging.getLogger("tinker_engine_verl")


def initial_adam() -> AdamParams:
    """The AdamW settings verl builds its optimizer with: Tinker's AdamParams defaults (protocol.json).
    Every optim_step then sets lr, betas, eps, weight decay and clipping from the job's ``adam``."""
    return AdamParams.parse({})


def _clip_grad(hp: AdamParams) -> float:
    """verl's ``clip_grad`` for ``grad_clip_norm`` (0: no clipping)."""
    return hp.grad_clip_norm if hp.grad_clip_norm > 0 else math.inf


def peft_key(name: str) -> str:
    """The adapter-name-free PEFT key of a verl LoRA parameter name (FSDP wrapper prefixes removed)."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    name = name.replace(".default.", ".", 1)
    return name if name.startswith("base_model.model.") else "base_model.model." + name


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded DTensor) parameter or state; collective for DTensors."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``full`` (CPU) laid out like ``ref`` (same device, dtype, sharding); collective for DTensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(ref, DTensor):
        return distribute_tensor(full.to(device=ref.device, dtype=ref.dtype), ref.device_mesh, ref.placements)
    return full.to(device=ref.device, dtype=ref.dtype)


def _copy_into(p: torch.Tensor, full: torch.Tensor) -> None:
    value = _like(full, p)
    with torch.no_grad():
        p.copy_(value)  # a DTensor into a DTensor of the same placements: each rank copies its shard


@dataclass
class BaseInfo:
    """A ``load_base`` entry: the directory and what ``parse_datum`` checks against."""

    name: str
    path: str
    vocab_size: int
    input_vocab_size: int
    arch: str
    max_context_length: int
    eos_token_id: int | None
    #: How verl trains it: padding, checkpointing, micro-batch tokens (levers.py), chosen at load_base.
    levers: levers.Levers | None = None

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "arch": self.arch,
                "max_context_length": self.max_context_length, "eos_token_id": self.eos_token_id}


@dataclass
class VerlModel:
    model_id: str
    base: BaseInfo
    lora: LoraSpec
    worker: Any
    hyper: dict[str, Any] | None = None  # the last optim_step's AdamW hyperparameters
    steps: int = 0

    @property
    def engine(self) -> Any:
        return self.worker.engine

    def lora_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(PEFT key, parameter) of every LoRA matrix, sorted by key (the torch engine's init order)."""
        named = [(peft_key(n), p) for n, p in self.engine.module.named_parameters()
                 if p.requires_grad and (".lora_A." in n or ".lora_B." in n)]
        return sorted(named, key=lambda kv: kv[0])


@dataclass
class VerlEngine:
    rank: int = 0
    world_size: int = 1
    bases: dict[str, BaseInfo] = field(default_factory=dict)
    models: dict[str, VerlModel] = field(default_factory=dict)
    record_seq: int = 0

    def __post_init__(self) -> None:
        settings()  # read as the engine starts: a bad setting stops it before the first request
        self.ops = {
            "hello": self.hello, "load_base": self.load_base, "create_model": self.create_model,
            "forward_backward": self.forward_backward, "optim_step": self.optim_step,
            "save_sampler": self.save_sampler, "save_state": self.save_state, "load_state": self.load_state,
            "unload_model": self.unload_model, "sample": self.sample, "memory": self.memory,
        }

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        handler = self.ops.get(op)
        if handler is None:
            raise KeyError(f"unknown op '{op}'; known: {', '.join(self.ops)}")
        return handler(args)

    # --- simple ops ------------------------------------------------------------------------------

    def hello(self, args: dict[str, Any]) -> dict[str, Any]:
        import verl

        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return {"protocol": PROTOCOL_VERSION, "engine": "verl", "device": device, "torch": torch.__version__,
                "verl": getattr(verl, "__version__", "?"), "world_size": self.world_size}

    def load_base(self, args: dict[str, Any]) -> dict[str, Any]:
        from transformers import AutoConfig, AutoTokenizer

        name, path = get_str(args, "name"), os.path.abspath(get_str(args, "path"))
        existing = self.bases.get(name)
        if existing is not None:
            if existing.path != path:
                raise UserError(f"base model '{name}' is already loaded from {existing.path}, not {path}")
            return existing.info()
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"load_base: {path} is not a model directory (no config.json)")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        text = getattr(config, "text_config", None) or config
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        vocab = int(text.vocab_size)
        base = BaseInfo(name=name, path=path, vocab_size=vocab, input_vocab_size=vocab,
                        arch=(config.architectures or [config.model_type])[0],
                        max_context_length=int(getattr(text, "max_position_embeddings", 0) or 0),
                        eos_token_id=None if tok.eos_token_id is None else int(tok.eos_token_id),
                        levers=self._levers(config))
        if self.rank == 0:
            log.info("verl levers for %s: %s", name, base.levers.describe())  # type: ignore[union-attr]
        self.bases[name] = base
        return base.info()

    def _levers(self, config: Any) -> levers.Levers:
        """The levers for a base model of ``config`` on this rank's device (levers.py)."""
        s = settings()
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if torch.cuda.is_available() else None
        device = torch.device("cuda") if gpu is not None else torch.device("cpu")
        return levers.choose(
            levers.Shape.of(config), gpu_bytes=gpu, ranks=self.world_size, remove_padding=s.remove_padding,
            grad_ckpt=s.grad_ckpt, attn=s.attn, ceiling=max_batch_tokens(),
            varlen=varlen.register() if varlen.available(device) else None,
            unpackable="the VeOmni strategy: its packed path is not wired here" if s.strategy == "veomni" else None)

    def base(self, name: str) -> BaseInfo:
        base = self.bases.get(name)
        if base is None:
            raise UserError(f"base model '{name}' is not loaded")
        return base

    def model(self, model_id: str) -> VerlModel:
        model = self.models.get(model_id)
        if model is None:
            raise UserError(f"unknown model_id '{model_id}'")
        return model

    def memory(self, args: dict[str, Any]) -> dict[str, Any]:
        """The torch engine's ``memory`` op for this rank's GPU (rank 0's figures reach the channel)."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return device_memory(device, str(device), bool(args.get("reset_peak")), bool(args.get("release")))

    def sample(self, args: dict[str, Any]) -> dict[str, Any]:
        raise UserError("the verl engine trains only: sample through a vLLM or torch agent serving this base model")

    def unload_model(self, args: dict[str, Any]) -> dict[str, Any]:
        model_id = get_str(args, "model_id")
        model = self.models.pop(model_id, None)
        if model is not None:
            del model.worker
            torch.cuda.empty_cache()
        return {"model_id": model_id}

    # --- create_model ----------------------------------------------------------------------------

    def _worker_config(self, base: BaseInfo, lora: LoraSpec) -> Any:
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig

        try:
            from verl.trainer.config import CheckpointConfig
        except ImportError:  # pragma: no cover - layout of other verl versions
            from verl.trainer.config.config import CheckpointConfig

        s = settings()
        lev = base.levers
        assert lev is not None
        model_config = HFModelConfig(
            path=base.path, lora_rank=lora.rank, lora_alpha=lora.rank, target_modules=lora.target_modules(),
            use_remove_padding=lev.remove_padding, enable_gradient_checkpointing=lev.grad_ckpt,
            override_config={"attn_implementation": lev.attn})
        if s.strategy == "veomni":
            engine_config = veomni.engine_config(self.world_size, s.offload, lev.max_tokens, s.attn)
            optimizer_config = veomni.optimizer_config()
        else:
            engine_config = FSDPEngineConfig(
                strategy=s.strategy, forward_only=False, use_dynamic_bsz=True,
                max_token_len_per_gpu=lev.max_tokens, use_remove_padding=lev.remove_padding, use_torch_compile=False,
                param_offload=s.offload, optimizer_offload=s.offload,
                mixed_precision=cpu.FP32 if cpu.on_cpu() else None)
            adam = initial_adam()
            optimizer_config = FSDPOptimizerConfig(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), weight_decay=adam.weight_decay,
                clip_grad=_clip_grad(adam), total_training_steps=1, lr_warmup_steps=0,
                override_optimizer_config={"eps": adam.eps})
        return TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                    engine_config=engine_config, optimizer_config=optimizer_config,
                                    checkpoint_config=CheckpointConfig())

    def create_model(self, args: dict[str, Any]) -> dict[str, Any]:
        if cpu.on_cpu():
            cpu.install()  # before verl builds anything: its platform must be the CPU one
        compat.apply()
        from verl.workers.engine_workers_tinker import TinkerTrainingWorker

        model_id = get_str(args, "model_id")
        base = self.base(get_str(args, "base_model"))
        lora = LoraSpec.parse(get_obj(args, "lora"))
        existing = self.models.get(model_id)
        if existing is not None:
            if existing.base is base and existing.lora == lora:
                return {"model_id": model_id, "lora_rank": lora.rank}
            raise UserError(f"model_id '{model_id}' already exists with a different configuration")
        worker = TinkerTrainingWorker(self._worker_config(base, lora))
        # verl's VeOmni engine applies no LoRA itself: its builders get this model's (veomni.py).
        s = settings()
        with (veomni.lora_build(lora, base.path, base.levers.grad_ckpt) if s.strategy == "veomni" else contextlib.nullcontext()):  # type: ignore[union-attr]
            worker.reset()
        if cpu.on_cpu():
            # verl's forward autocasts to the engine's _autocast_dtype (bf16 unless its FSDP build set
            # another; its VeOmni engine never does): CPU ranks compute in float32.
            worker.engine._autocast_dtype = torch.float32
        model = VerlModel(model_id=model_id, base=base, lora=lora, worker=worker)
        with model.engine.train_mode(zero_grad_on_exit=False):
            params = model.lora_params()
            if not params:
                raise UserError(f"base model '{base.name}' has none of the LoRA target modules {lora.target_modules()}")
            values = seeded_lora_values([(k, tuple(p.shape)) for k, p in params], lora.seed)
            for (_, p), value in zip(params, values):
                _copy_into(p, value)
        self.models[model_id] = model
        return {"model_id": model_id, "lora_rank": lora.rank}

    # --- forward_backward ------------------------------------------------------------------------

    def forward_backward(self, args: dict[str, Any]) -> dict[str, Any]:
        from verl.utils import tensordict_utils as tu

        model = self.model(get_str(args, "model_id"))
        req = parse_forward_backward(args, model.base)
        spec, config, forward_only, datums = req.loss, req.config, req.forward_only, req.datums
        for d in datums:
            translate.check_next_token_targets(d)

        names = translate.input_names_for(spec, datums)
        rows = translate.shard_rows(len(datums), self.world_size, self.rank)
        fields = translate.build_fields(datums, rows, names)
        lev = model.base.levers
        assert lev is not None
        meta = translate.non_tensor_fields(fields, lev.max_tokens, lev.remove_padding)
        td = tu.get_tensordict(tensor_dict=dict(fields), non_tensor_dict=dict(meta))
        loss_fn = translate.make_loss_fn(spec, config, names)
        model.worker.set_loss_fn(loss_fn)
        if forward_only:
            engine = model.engine
            with engine.eval_mode():
                out = engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=True)
            log_probs = out["model_output"]["log_probs"]
            local_sum = float(torch.tensor(out["loss"], dtype=torch.float64).sum()) / self.world_size
        else:
            out = model.worker.forward_backward(td)
            log_probs = out["log_probs"]
            local_sum = None
            metrics = tu.get(out, "metrics")
            total = float(metrics["loss"])
        per_row = translate.row_logprobs(log_probs, fields)
        if forward_only:
            # out["loss"] holds local sums times world_size; the total is their sum over ranks.
            t = torch.tensor([local_sum], dtype=torch.float64, device=_comm_device())
            if self.world_size > 1:
                dist.all_reduce(t)
            total = float(t.item())
        mine = [(r, lp) for r, lp in zip(rows, per_row) if r is not None]
        gathered: list[Any] = [mine]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
        by_index = {r: lp for part in gathered for r, lp in part}
        outputs = [by_index[i] for i in range(len(datums))]
        s = settings()
        small = sum(int(d.tokens.shape[0]) for d in datums) <= s.record_max_tokens
        if s.record and self.rank == 0 and small:
            self._record(args, fields, meta, log_probs, outputs, total)
        return {"loss_fn_outputs": [{"logprobs": wire(lp)} for lp in outputs],
                "metrics": {"loss:sum": total}}

    def _record(self, args: dict[str, Any], fields: dict[str, torch.Tensor], meta: dict[str, Any],
                log_probs: torch.Tensor, outputs: list[torch.Tensor], total: float) -> None:
        directory = settings().record
        assert directory is not None
        os.makedirs(directory, exist_ok=True)
        self.record_seq += 1
        fixture = {
            "format": 1, "verl_version": _verl_version(), "torch": torch.__version__,
            "world_size": self.world_size, "rank": self.rank,
            "request": _jsonable({k: args[k] for k in ("loss_fn", "loss_fn_config", "forward_only", "data") if k in args}),
            "fields": translate.describe_fields(fields),
            "non_tensor": meta,
            "verl_log_probs": translate.describe_fields({"log_probs": log_probs.detach().to("cpu")})["log_probs"],
            "result": {"loss:sum": total, "logprobs": [lp.tolist() for lp in outputs]},
        }
        path = os.path.join(directory, f"fb_{self.record_seq:03d}_{args.get('loss_fn')}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(fixture, f)

    # --- optim_step ------------------------------------------------------------------------------

    def optim_step(self, args: dict[str, Any]) -> dict[str, Any]:
        model = self.model(get_str(args, "model_id"))
        hp = AdamParams.parse(get_obj(args, "adam"))
        engine = model.engine
        groups = engine.optimizer.param_groups
        betas_type = type(groups[0]["betas"])
        engine.optimizer_config.clip_grad = _clip_grad(hp)
        params = {"lr": hp.learning_rate, "betas": betas_type((hp.beta1, hp.beta2)), "eps": hp.eps,
                  "weight_decay": hp.weight_decay}
        metrics = model.worker.optimizer_step(params)
        model.hyper = {"lr": params["lr"], "betas": [params["betas"][0], params["betas"][1]],
                       "eps": params["eps"], "weight_decay": params["weight_decay"]}
        model.steps += 1
        grad_norm = float(metrics.get("grad_norm", float("nan")))
        return {"metrics": {"grad_norm": grad_norm, "learning_rate": hp.learning_rate}}

    # --- adapters and checkpoints ------------------------------------------------------------------

    def _full_lora(self, model: VerlModel) -> dict[str, torch.Tensor]:
        with model.engine.train_mode(zero_grad_on_exit=False):
            return {k: _full(p.detach()).to("cpu", torch.float32).contiguous() for k, p in model.lora_params()}

    def _write_adapter(self, model: VerlModel, tensors: dict[str, torch.Tensor], directory: str) -> int:
        from safetensors.torch import save_file

        config = model.lora.peft_config(model.base.path)
        config.inference_mode = True
        config.save_pretrained(directory)
        _normalise_config(os.path.join(directory, "adapter_config.json"))
        save_file(dict(sorted(tensors.items())), os.path.join(directory, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        return sum(os.path.getsize(os.path.join(directory, f)) for f in ADAPTER_FILES)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def save_sampler(self, args: dict[str, Any]) -> dict[str, Any]:
        model = self.model(get_str(args, "model_id"))
        directory = get_str(args, "dir")
        tensors = self._full_lora(model)
        size = 0
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".tmp-adapter-{secrets.token_hex(6)}")
            os.mkdir(tmp)
            try:
                size = self._write_adapter(model, tensors, tmp)
                for fname in ADAPTER_FILES:
                    os.replace(os.path.join(tmp, fname), os.path.join(directory, fname))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        return {"dir": directory, "size_bytes": size}

    def _optimizer_payload(self, model: VerlModel) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        opt = model.engine.optimizer
        tensors: dict[str, torch.Tensor] = {}
        steps: dict[str, float] = {}
        with model.engine.train_mode(zero_grad_on_exit=False):
            for key, p in model.lora_params():
                st = opt.state.get(p)
                if not st:
                    continue
                steps[key] = float(_full(st["step"]) if isinstance(st["step"], torch.Tensor) else st["step"])
                for moment in MOMENTS:
                    tensors[f"{moment}/{key}"] = _full(st[moment]).detach().to("cpu", torch.float32).contiguous()
        hyper = model.hyper if steps else None
        return tensors, {"format": STATE_FORMAT, "optimizer": "adamw", "hyperparameters": hyper, "step": steps}

    def save_state(self, args: dict[str, Any]) -> dict[str, Any]:
        from safetensors.torch import save_file

        model = self.model(get_str(args, "model_id"))
        path, with_optimizer = save_state_target(args)
        self._barrier()  # every rank checked before rank 0 creates it
        tensors = self._full_lora(model)
        opt_tensors, opt_meta = self._optimizer_payload(model) if with_optimizer else ({}, {})
        size = 0
        if self.rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{secrets.token_hex(6)}"
            os.mkdir(tmp)
            try:
                self._write_adapter(model, tensors, tmp)
                if with_optimizer:
                    save_file(opt_tensors, os.path.join(tmp, OPTIMIZER_TENSORS), metadata={"format": "pt"})
                    _write_json(os.path.join(tmp, OPTIMIZER_META), opt_meta)
                _write_json(os.path.join(tmp, STATE_FILE), {
                    "format": STATE_FORMAT, "base_model": model.base.name, "lora": _lora_json(model),
                    "has_optimizer": with_optimizer})
                size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
                _fsync_dir_tree(tmp)
                os.rename(tmp, path)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _fsync_path(os.path.dirname(path))
        self._barrier()
        return {"dir": get_str(args, "dir"), "size_bytes": size}

    def load_state(self, args: dict[str, Any]) -> dict[str, Any]:
        model = self.model(get_str(args, "model_id"))
        path, with_optimizer, has_optimizer = check_state_dir(args, model)
        weights_path = os.path.join(path, "adapter_model.safetensors")
        weights = _read_tensors(weights_path)
        engine = model.engine
        with engine.train_mode(zero_grad_on_exit=False):
            keyed = dict(model.lora_params())
            missing, extra = sorted(set(keyed) - set(weights)), sorted(set(weights) - set(keyed))
            if missing or extra:
                raise UserError(f"load_state: {weights_path} does not match the model's LoRA parameters "
                                f"(missing {missing[:3]}, unexpected {extra[:3]})")
            for key, p in keyed.items():
                _check_tensor(weights_path, key, weights[key], _FullShape(p))
            opt_state = self._read_optimizer(path, keyed) if with_optimizer else None
            # Commit.
            for key, p in keyed.items():
                _copy_into(p, weights[key].float())
            engine.optimizer_zero_grad()
            opt = engine.optimizer
            for p in keyed.values():
                opt.state.pop(p, None)
            model.hyper, model.steps = None, 0
            if opt_state is not None:
                hyper, entries = opt_state
                for key, (step, moments) in entries.items():
                    p = keyed[key]
                    opt.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                    **{m: _like(moments[m].float(), p.detach()) for m in MOMENTS}}
                if hyper is not None:
                    for group in opt.param_groups:
                        group["lr"] = hyper["lr"]
                        group["betas"] = type(group["betas"])(hyper["betas"])
                        group["eps"] = hyper["eps"]
                        group["weight_decay"] = hyper["weight_decay"]
                    model.hyper = hyper
        return {"model_id": model.model_id, "has_optimizer": has_optimizer}

    def _read_optimizer(self, path: str, keyed: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        return read_optimizer_files(path, keyed, _FullShape)


class _FullShape:
    """What ``_check_tensor`` reads of a parameter (its shape), for a sharded one: the full shape."""

    def __init__(self, p: torch.Tensor) -> None:
        self.shape = p.shape  # a DTensor reports its global shape


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _jsonable(value: Any) -> Any:
    """A request as JSON for a recorded fixture: its binary tensors as inline JSON tensors."""
    if isinstance(value, torch.Tensor):
        return tensor_to_json(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _verl_version() -> str:
    try:
        import verl

        return str(getattr(verl, "__version__", "?"))
    except ImportError:
        return "?"
