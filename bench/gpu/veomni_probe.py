#!/usr/bin/env python3
"""Probe: can verl 0.9.1's VeOmni engine (``strategy: veomni``) train a model here? (issue 11)

Run on the H200 with the verl kit and the VeOmni kit installed into one directory on PYTHONPATH
(kits: bench/gpu/build_verl_carry.sh .verlcarry, bench/gpu/build_veomni_carry.sh .veomnicarry; 47 +
1.8 MiB, one carry):

    pip install -q --no-index --no-deps --no-compile --target /tmp/site .verlcarry/*.whl .veomnicarry/*.whl
    python3 bench/gpu/make_random_qwen3.py --shape 0.6b --out /tmp/m --device cuda   # or any local model dir
    PYTHONPATH=/tmp/site python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
        bench/gpu/veomni_probe.py --model /tmp/m [--variant stock|peft|both] [--attn sdpa] [--rmpad 0|1]

With one rank VeOmni does not shard (its fsdp_enabled is world_size > 1) and refuses init_device
meta, so ``--init-device auto`` builds on cuda: a plain module, no FSDP. The FSDP2 path needs two ranks
(``--nproc_per_node=2`` on a two-GPU machine), where auto picks meta.

What it does, printing ``[stage] OK …`` or ``[stage] FAIL`` with the full traceback for each:

  env       versions of torch / transformers / peft / verl / veomni / tensordict, the GPU, and which
            optional kernels (flash_attn, liger_kernel, triton, flash_linear_attention) import;
  import    ``verl.workers.engine`` with its warnings (verl silently sets VeOmniEngine = None when
            ``import veomni`` fails) and ``EngineRegistry.get_engine_cls("language_model", "veomni")``;
  config    ``HFModelConfig`` (lora_rank, lora_alpha, target_modules), ``VeOmniEngineConfig``
            (strategy veomni, attn ``--attn``, no torch.compile, dynamic batch), ``VeOmniOptimizerConfig``,
            ``TrainingWorkerConfig`` — the same construction as workers/python/tinker_engine_verl with
            the FSDP classes swapped for the VeOmni ones;
  worker    ``TinkerTrainingWorker(config)`` (VeOmniEngine.__init__: VeOmni's parallel_state) and
            ``worker.reset()`` (VeOmniEngine.initialize: build_foundation_model + build_parallelize_model
            + VeOmni's build_optimizer);
  params    trainable / total parameters and how many are LoRA matrices — verl 0.9.1's VeOmniEngine
            never applies PEFT (``_is_lora`` is set and unused; "TODO: support VeOmni LoRA"), so the
            ``stock`` variant is expected to train every parameter;
  fb, step  one ``worker.forward_backward`` on 4 random next-token rows with a sum-of-NLL loss, then
            ``worker.optimizer_step({lr, betas, eps, weight_decay})``, then a forward-only pass on the
            same rows (the loss must move), the gradient norm and peak GPU memory.

Variants: ``stock`` = verl's VeOmniEngine as shipped (LoRA settings ignored → full fine-tune);
``peft`` = the same engine with the two VeOmni builders it calls wrapped (``install_peft_patch``): the
built model gets ``peft.get_peft_model`` before VeOmni parallelizes it with ``is_peft_model=True`` (what
VeOmni's own trainer does for LoRA): the closest thing to a LoRA
VeOmni strategy, i.e. what a patch of verl would need. ``both`` runs stock then peft in one process
(VeOmni's parallel state is global and is reused by the second engine).

``--cpu`` (no GPU; this machine): gloo, ``VERL_ENGINE_DEVICE=cuda`` so verl's registry (cuda/npu only)
hands out the VeOmni engine class, and shims for verl's CUDA-only calls (its CUDA platform object is
used even without a GPU: ``torch.cuda.current_device`` / ``mem_get_info`` / ``max_memory_allocated``)
and for VeOmni's one-rank init_device check. Measured here (torch 2.13 CPU, transformers 5.17, peft
0.21, verl 0.9.1 with the verl kit's pins), tiny Qwen3, 1 and 2 ranks: with veomni 0.1.12 every stage
of both variants ran; with veomni 0.1.11 (verl's pinned one) forward_backward fails with
"TypeError: create_causal_mask() got an unexpected keyword argument 'cache_position'" unless
MODELING_BACKEND=hf (then it runs on transformers' own Qwen3 modeling).

Self-contained: imports nothing from workers/. Exit code 0 only when every stage of every variant ran;
a JSON summary goes to ``--json`` (default $OUT/veomni_probe.json).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any, Callable

RESULTS: list[dict[str, Any]] = []
RANK = int(os.environ.get("RANK", "0"))


def say(msg: str) -> None:
    if RANK == 0:
        print(msg, flush=True)


def stage(name: str, fn: Callable[[], Any], variant: str = "") -> tuple[bool, Any]:
    label = f"{variant}:{name}" if variant else name
    t0 = time.time()
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - the probe reports everything
        if isinstance(exc, KeyboardInterrupt):
            raise
        dt = time.time() - t0
        tb = traceback.format_exc()
        say(f"[{label}] FAIL after {dt:.1f}s: {type(exc).__name__}: {exc}\n{tb}")
        RESULTS.append({"stage": label, "ok": False, "seconds": round(dt, 2),
                        "error": f"{type(exc).__name__}: {exc}", "traceback_tail": tb.strip().splitlines()[-12:]})
        return False, None
    dt = time.time() - t0
    shown = value if isinstance(value, (str, int, float, dict, list)) or value is None else type(value).__name__
    say(f"[{label}] OK in {dt:.1f}s: {shown}")
    RESULTS.append({"stage": label, "ok": True, "seconds": round(dt, 2),
                    "value": shown if isinstance(shown, (str, int, float, dict, list)) else None})
    return True, value


# --- env ------------------------------------------------------------------------------------------

def env_info(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available(), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    for mod in ("transformers", "peft", "tensordict", "verl", "veomni", "accelerate", "datasets", "torchdata",
                "flash_attn", "liger_kernel", "triton", "fla", "einops", "timm", "blobfile", "tiktoken"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = importlib.import_module(mod)
            info[mod] = str(getattr(m, "__version__", "?"))
        except BaseException as exc:  # noqa: BLE001
            info[mod] = f"absent ({type(exc).__name__}: {str(exc)[:120]})"
    info["MODELING_BACKEND"] = os.environ.get("MODELING_BACKEND", "(unset: veomni)")
    info["model_dir"] = os.listdir(args.model) if os.path.isdir(args.model) else f"not a directory: {args.model}"
    return info


def import_engine() -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import verl.workers.engine as eng  # noqa: F401
    veomni_warnings = [str(w.message) for w in caught if "veomni" in str(w.message).lower()]
    if eng.__dict__.get("VeOmniEngine") is None:
        raise RuntimeError(f"verl.workers.engine.VeOmniEngine is None: {veomni_warnings}")
    from verl.workers.engine import EngineRegistry

    cls = EngineRegistry.get_engine_cls("language_model", "veomni")
    return {"engine_class": f"{cls.__module__}.{cls.__qualname__}", "warnings": veomni_warnings,
            "VERL_ENGINE_DEVICE": os.environ.get("VERL_ENGINE_DEVICE")}


def cpu_shims() -> str:
    """--cpu only: verl's CUDA platform is used even without a GPU; make it answer "cpu"."""
    import torch
    import verl.workers.engine.veomni.transformer_impl as ti
    from verl.plugin.platform import get_platform

    plat = type(get_platform())
    plat.device_name = property(lambda self: "cpu")
    class _CpuModule:  # torch.cpu, plus the torch.cuda memory / name queries verl's metrics make
        def __getattr__(self, name: str) -> Any:
            if hasattr(torch.cpu, name):
                return getattr(torch.cpu, name)
            if name == "get_device_name":
                return lambda *a, **k: "cpu"
            if name == "mem_get_info":
                return lambda *a, **k: (0, 0)
            return lambda *a, **k: 0

    cpu_mod = _CpuModule()
    plat.device_module = property(lambda self: cpu_mod)
    plat.current_device = lambda self: "cpu"
    plat.synchronize = lambda self, device_index=None: None
    plat.empty_cache = lambda self: None
    ti.log_gpu_memory_usage = lambda *a, **k: None
    orig_parallelize = ti.build_parallelize_model

    def build_parallelize_model(module: Any, **kw: Any) -> Any:
        # One rank, no FSDP: VeOmni insists on init_device cuda/npu (it reads it only for that check).
        if kw.get("init_device") == "cpu":
            kw["init_device"] = "cuda"
        return orig_parallelize(module, **kw)

    ti.build_parallelize_model = build_parallelize_model
    return (f"{plat.__name__}: device_name/current_device -> 'cpu', synchronize/empty_cache no-ops; "
            "veomni transformer_impl.log_gpu_memory_usage stubbed; one rank: init_device cpu passes VeOmni's no-FSDP check")


# --- config ---------------------------------------------------------------------------------------

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def init_device(args: argparse.Namespace) -> str:
    """VeOmni allows ``meta`` only when it shards (world size > 1); one rank must build on ``cuda``."""
    if args.init_device != "auto":
        return args.init_device
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "meta"
    return "cpu" if args.cpu else "cuda"


def build_config(args: argparse.Namespace) -> Any:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, TrainingWorkerConfig, VeOmniEngineConfig, VeOmniOptimizerConfig

    rmpad = bool(args.rmpad)
    model_config = HFModelConfig(
        path=os.path.abspath(args.model), lora_rank=args.lora_rank, lora_alpha=args.lora_rank,
        target_modules=TARGETS, use_remove_padding=rmpad, enable_gradient_checkpointing=bool(args.grad_ckpt),
        override_config={"attn_implementation": args.attn})
    engine_config = VeOmniEngineConfig(
        strategy="veomni", forward_only=False, use_dynamic_bsz=True, max_token_len_per_gpu=args.max_tokens,
        use_remove_padding=rmpad, use_torch_compile=False, attn_implementation=args.attn,
        moe_implementation="eager", mixed_precision=bool(args.mixed_precision), init_device=init_device(args),
        param_offload=False, optimizer_offload=False, enable_full_shard=True)
    optimizer_config = VeOmniOptimizerConfig(
        lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, clip_grad=1.0, total_training_steps=1,
        lr_warmup_steps=0, lr_scheduler_type="constant")
    cfg = TrainingWorkerConfig(model_type="language_model", model_config=model_config, engine_config=engine_config,
                               optimizer_config=optimizer_config, checkpoint_config=CheckpointConfig())
    return cfg


def describe_config(cfg: Any) -> dict[str, Any]:
    e, m = cfg.engine_config, cfg.model_config
    return {"engine_config": type(e).__name__, "strategy": e.strategy, "init_device": e.init_device, "attn_implementation": e.attn_implementation,
            "moe_implementation": e.moe_implementation, "mixed_precision": e.mixed_precision,
            "use_remove_padding": m.use_remove_padding, "lora_rank": m.lora_rank,
            "target_modules": list(m.target_modules) if m.target_modules is not None else None,
            "optimizer_config": type(cfg.optimizer_config).__name__}


# --- the peft variant -----------------------------------------------------------------------------

def install_peft_patch(args: argparse.Namespace) -> str:
    """LoRA for verl's VeOmni engine without changing its code: the two VeOmni builders its
    ``_build_model_optimizer`` calls (names in verl's module) are wrapped. The model VeOmni builds
    gets PEFT LoRA adapters (this probe's rank, alpha = rank, TARGETS), and the parallelizer is told
    so (``is_peft_model=True``, as VeOmni's own trainer passes for LoRA)."""
    import verl.workers.engine.veomni.transformer_impl as ti
    from peft import LoraConfig, TaskType, get_peft_model

    build_model, parallelize = ti.build_foundation_model, ti.build_parallelize_model

    def with_lora(*a: Any, **kw: Any) -> Any:
        module = build_model(*a, **kw)
        if args.grad_ckpt:
            module.enable_input_require_grads()
        return get_peft_model(module, LoraConfig(task_type=TaskType.CAUSAL_LM, r=args.lora_rank, lora_alpha=args.lora_rank,
                                                 target_modules=list(TARGETS), bias="none"))

    def parallelize_peft(module: Any, **kw: Any) -> Any:
        return parallelize(module, **{**kw, "is_peft_model": True})

    ti.build_foundation_model, ti.build_parallelize_model = with_lora, parallelize_peft
    return f"verl's VeOmni builders wrapped: get_peft_model(r={args.lora_rank}) + is_peft_model=True"


# --- training -------------------------------------------------------------------------------------

def param_report(worker: Any) -> dict[str, Any]:
    import torch

    module = worker.engine.module
    total = trainable = lora = 0
    dtypes: dict[str, int] = {}
    for name, p in module.named_parameters():
        n = p.numel()
        total += n
        if p.requires_grad:
            trainable += n
            dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + n
        if ".lora_A." in name or ".lora_B." in name:
            lora += n
    from torch.distributed.tensor import DTensor

    first = next(iter(module.parameters()))
    return {"module": type(module).__name__, "params_total": total, "params_trainable": trainable,
            "params_lora": lora, "trainable_dtypes": dtypes, "dtensor": isinstance(first, DTensor),
            "device": str(first.device), "optimizer": type(worker.engine.optimizer).__name__,
            "cuda_mem_gib": round(torch.cuda.memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None}


def make_batch(vocab: int, n_rows: int, seed: int, rmpad: bool, max_tokens: int) -> tuple[Any, list[int]]:
    import torch
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(16, 65, (n_rows,), generator=g)]
    ids = [torch.randint(0, vocab, (n,), generator=g, dtype=torch.int64) for n in lengths]
    jag = lambda rows: torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)  # noqa: E731
    fields = {
        "input_ids": jag(ids),
        "position_ids": jag([torch.arange(n, dtype=torch.int64) for n in lengths]),
        "loss_mask": jag([torch.cat([torch.ones(n - 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)])
                          for n in lengths]),
    }
    meta = {"temperature": 1.0, "use_remove_padding": rmpad, "use_dynamic_bsz": True,
            "max_token_len_per_gpu": int(max(max_tokens, max(lengths))), "global_token_num": lengths,
            "calculate_entropy": False}
    return tu.get_tensordict(tensor_dict=fields, non_tensor_dict=meta), lengths


def nll_loss_fn(model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, dict[str, Any]]:
    """Sum of -log p over loss-mask positions (verl's rolled logprobs), times dp_size (FSDP averages)."""
    import torch

    lp = model_output["log_probs"]
    mask = data["loss_mask"]
    lp_v = lp.values() if getattr(lp, "is_nested", False) else lp
    m_v = mask.values() if getattr(mask, "is_nested", False) else mask
    total = -(lp_v.float() * m_v.to(lp_v.device, torch.float32)).sum()
    dp_size = data.get("dp_size", 1)
    dp_size = int(getattr(dp_size, "data", dp_size) or 1)
    return total * dp_size, {}


def run_variant(variant: str, args: argparse.Namespace) -> bool:
    import torch

    say(f"\n===== variant {variant} =====")
    if variant == "peft":
        ok, _ = stage("patch", lambda: install_peft_patch(args), variant)
        if not ok:
            return False
    ok, cfg = stage("config", lambda: build_config(args), variant)
    if not ok:
        return False
    say(f"[{variant}:config] {json.dumps(describe_config(cfg))}")
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

    ok, worker = stage("worker", lambda: TinkerTrainingWorker(cfg), variant)
    if not ok:
        return False
    say(f"[{variant}:worker] engine {type(worker.engine).__module__}.{type(worker.engine).__name__}")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    ok, _ = stage("reset", lambda: worker.reset(), variant)
    if not ok:
        return False
    ok, rep = stage("params", lambda: param_report(worker), variant)
    if ok and rep["params_lora"] == 0 and args.lora_rank > 0:
        say(f"[{variant}:params] NOTE lora_rank={args.lora_rank} was requested but the module has no LoRA "
            f"matrices: {rep['params_trainable']} of {rep['params_total']} parameters train (full fine-tune)")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model, local_files_only=True)
    vocab = min(int(getattr(getattr(hf, "text_config", None) or hf, "vocab_size")), args.vocab_cap)
    td, lengths = make_batch(vocab, 4, 7, bool(args.rmpad), args.max_tokens)
    say(f"[{variant}:batch] 4 rows, lengths {lengths}, ids < {vocab}")
    worker.set_loss_fn(nll_loss_fn)

    def fb() -> dict[str, Any]:
        from verl.utils import tensordict_utils as tu

        out = worker.forward_backward(td)
        metrics = tu.get(out, "metrics")
        lp = out["log_probs"]
        vals = lp.values() if getattr(lp, "is_nested", False) else lp
        grads = [p.grad for p in worker.engine.module.parameters() if p.requires_grad and p.grad is not None]
        return {"loss": float(metrics["loss"]), "log_probs_shape": list(vals.shape),
                "mean_lp": float(vals.float().mean()), "params_with_grad": len(grads)}

    ok, res = stage("forward_backward", fb, variant)
    if not ok:
        return False

    def step() -> dict[str, Any]:
        groups = worker.engine.optimizer.param_groups
        betas_type = type(groups[0]["betas"])
        metrics = worker.optimizer_step({"lr": 1e-3, "betas": betas_type((0.9, 0.95)), "eps": 1e-8,
                                         "weight_decay": 0.0})
        return {k: float(v) for k, v in metrics.items()}

    ok, _ = stage("optimizer_step", step, variant)
    if not ok:
        return False

    def forward_only() -> dict[str, Any]:
        td2, _ = make_batch(vocab, 4, 7, bool(args.rmpad), args.max_tokens)
        engine = worker.engine
        for key in ("use_fused_kernels",):
            from verl.utils import tensordict_utils as tu

            tu.assign_non_tensor(td2, **{key: False})
        with engine.eval_mode():
            out = engine.forward_backward_batch(td2, loss_function=nll_loss_fn, forward_only=True)
        loss = float(torch.tensor(out["loss"], dtype=torch.float64).sum())
        return {"loss_after_step": loss, "loss_before_step": res["loss"], "moved": loss != res["loss"]}

    ok, _ = stage("forward_after_step", forward_only, variant)
    if torch.cuda.is_available():
        say(f"[{variant}:memory] peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    del worker
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local HF model directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--variant", choices=["stock", "peft", "both"], default="both")
    ap.add_argument("--attn", default="sdpa", help="VeOmni attn_implementation (sdpa: no flash-attn on the H200 image)")
    ap.add_argument("--rmpad", type=int, default=0, help="use_remove_padding (1 needs varlen flash attention)")
    ap.add_argument("--grad-ckpt", type=int, default=1)
    ap.add_argument("--mixed-precision", type=int, default=1, help="fp32 master weights + bf16 compute (VeOmni's)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--init-device", default="auto", help="VeOmni init_device: auto = meta when WORLD_SIZE > 1 "
                    "(FSDP2), else cuda (VeOmni: 'Only FSDP training supports init_device=meta')")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--vocab-cap", type=int, default=1000, help="random ids below this (tiny tokenizers)")
    ap.add_argument("--cpu", action="store_true", help="no GPU: gloo, and VERL_ENGINE_DEVICE=cuda for the registry")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "veomni_probe.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cpu:
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available() and not args.cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group(backend="gloo")

    stage("env", lambda: env_info(args))
    ok, _ = stage("import", import_engine)
    if ok and args.cpu:
        stage("cpu_shims", cpu_shims)
    all_ok = ok
    if ok:
        variants = ["stock", "peft"] if args.variant == "both" else [args.variant]
        for v in variants:
            all_ok = run_variant(v, args) and all_ok
    if RANK == 0:
        summary = {"ok": all_ok, "stages": RESULTS, "args": vars(args)}
        try:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1, default=str)
            say(f"\n[summary] written {args.json}")
        except OSError as exc:
            say(f"[summary] could not write {args.json}: {exc}")
        say("[summary] " + " ".join(f"{r['stage']}={'ok' if r['ok'] else 'FAIL'}" for r in RESULTS))
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
