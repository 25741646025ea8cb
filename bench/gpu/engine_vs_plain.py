"""The torch engine, driven over its stdio channel as the agent drives it, against plain PyTorch + PEFT.

    python bench/gpu/engine_vs_plain.py --model 1.7b        # on a CUDA machine (also: 8b)
    python bench/gpu/engine_vs_plain.py --tiny              # CPU smoke test (seconds)

A random-initialised model with real Qwen3 dimensions (from a Qwen3Config; no hub) is written to
a temporary directory with a small local tokenizer (scripts/make_tiny_model.py; token ids are
random, the tokenizer only has to exist). Then:

- training: batch 8 x 1024 random tokens, cross_entropy, LoRA rank 32 on q/k/v/o/gate/up/down and
  lm_head, bf16 base, fp32 adapter, AdamW; forward_backward + optim_step per step. The plain run
  uses the engine's deterministic LoRA init, so both see the same losses (bf16 tolerance).
  Prints tokens/s, ms/step, peak memory, MFU (model FLOPs: 2 x forward matmuls, i.e. forward plus
  the input-gradient backward of the frozen base, + causal attention; against --peak-tflops).
- sampling, after training: 32 distinct prompts x 128 new tokens (as one sample_batch, the agent's
  gathered call, and as 32 sample calls sent back to back), and 1 prompt x 32 samples, against one
  batched ``generate`` of the same base model (temperature 1, no top-k/top-p, no early stop) loaded
  in this process; alternating in every round (--sample-rounds, after a warm-up round), medians and
  each round's ratio.

Everything prints at the end in one table; nothing but torch, transformers, peft and tokenizers.

Fused kernels (issue 35): ``--kernels none,liger`` runs the engine once per entry with that TB_ENGINE_KERNELS (the last run's
channel samples);
``--plain-kernels none,liger`` trains the plain model once per entry, in that order (Liger's RMSNorm,
SwiGLU and rotary embedding patched in for ``liger``: the anchor a PEFT user would pick; its fused
linear + cross-entropy is left out, as it would skip the LoRA on lm_head). The engine's losses are
compared with the first plain run's. ``--sample-rounds 0`` skips sampling. Liger needs the
liger-kernel package (a wheel on PYTHONPATH will do).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINE_DIR = REPO / "workers" / "python"
sys.path.insert(0, str(ENGINE_DIR))

import torch  # noqa: E402

from tinker_engine.channel import decode_frame, encode_frame  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    # Qwen3-1.7B and Qwen3-8B dimensions (config.json of the released checkpoints).
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    # A stand-in between the two, for CPU engines whose decode steps should be arithmetic, not Python
    # (bench/gpu/sampling_scale.sh's SCALE_SHAPE): ~26M parameters, the tiny tokenizer's vocabulary.
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=1536, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1536, tie_word_embeddings=True),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


# --- model directory -------------------------------------------------------------------------------

def write_model(name: str, out: Path, device: torch.device, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    assert spec is not None and spec.loader is not None
    make_tiny = importlib.util.module_from_spec(spec)
    sys.modules["make_tiny_model"] = make_tiny
    spec.loader.exec_module(make_tiny)
    tokenizer = make_tiny.build_tokenizer(make_tiny.TinySpec())
    config = Qwen3Config(**MODELS[name], max_position_embeddings=40960, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model


def load_plain(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()


# --- the engine over its channel ---------------------------------------------------------------------

class EngineChannel:
    """``python -m tinker_engine`` as the agent starts it: protocol 2 frames (JSON plus binary tensors) on stdio."""

    def __init__(self, device: str, dtype: str, kernels: str = "none") -> None:
        env = {**os.environ, "TB_ENGINE_KERNELS": kernels, "PYTHONPATH": os.pathsep.join(p for p in (str(ENGINE_DIR), os.environ.get("PYTHONPATH")) if p),
               "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TB_ENGINE_DEVICE": device, "TB_ENGINE_DTYPE": dtype, "TB_ENGINE_LOG_LEVEL": "WARNING"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tinker_engine"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.next_id = 0
        self.replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            head = self.proc.stdout.read(4)
            if len(head) < 4:
                return
            (n,) = struct.unpack(">I", head)
            msg = decode_frame(bytearray(self.proc.stdout.read(n)))
            with self.lock:
                box = self.replies.pop(msg["id"])
            box.put(msg)

    def send(self, op: str, args: dict[str, Any]) -> queue.Queue[dict[str, Any]]:
        self.next_id += 1
        box: queue.Queue[dict[str, Any]] = queue.Queue()
        with self.lock:
            self.replies[self.next_id] = box
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_frame({"id": self.next_id, "op": op, "args": args}))
        self.proc.stdin.flush()
        return box

    @staticmethod
    def result(box: queue.Queue[dict[str, Any]]) -> dict[str, Any]:
        msg = box.get(timeout=1800)
        if not msg["ok"]:
            raise RuntimeError(f"engine error: {msg['error']}")
        return msg["result"]

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        return self.result(self.send(op, args))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


# --- workloads ---------------------------------------------------------------------------------------

def training_data(n: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def engine_datums(inputs: torch.Tensor, targets: torch.Tensor) -> list[dict[str, Any]]:
    """As the agent sends them (protocol 2): binary tensors, token ids as int32."""
    return [{"tokens": x.to(torch.int32), "loss_fn_inputs": {
        "target_tokens": y.to(torch.int32), "weights": torch.ones(len(y), dtype=torch.float32)}}
        for x, y in zip(inputs, targets)]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


# The sample request fields the agent always sends (protocol.json), asking for nothing.
NO_SCORES = {"target_prompt_logprobs": None, "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0}


def sampling_params(max_tokens: int, seed: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": seed,
            "stop_tokens": [], "stop_strings": [], "stop_at_eos": False}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops_per_step(cfg: dict[str, Any], batch: int, seq: int) -> float:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    matmul_params = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter) + h * cfg["vocab_size"]
    tokens = batch * seq
    forward = 2 * matmul_params * tokens + 2 * layers * q * seq * tokens  # causal QK^T + AV, half the square
    return 2.0 * forward


def run_engine(args: argparse.Namespace, path: Path, w: dict[str, Any], out: dict[str, Any],
               kernels: str = "none") -> "EngineChannel":
    """The engine's training steps; returns its channel, still open, for the sampling rounds."""
    device = "cuda" if args.device == "cuda" else "cpu"
    eng = EngineChannel(device, "bfloat16" if device == "cuda" else "float32", kernels)
    try:
        eng.call("hello", {})
        eng.call("load_base", {"name": "bench", "path": str(path)})
        eng.call("create_model", {"model_id": "bench", "base_model": "bench",
                                  "lora": {"rank": w["rank"], "seed": 0, "train_attn": True, "train_mlp": True,
                                           "train_unembed": True}})
        inputs, targets = training_data(w["batch"], w["seq"], w["vocab"])
        data = engine_datums(inputs, targets)
        adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
                "grad_clip_norm": 0.0}
        fb_args = {"model_id": "bench", "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False,
                   "data": data}
        losses, times = [], []
        peak = 0
        for step in range(w["warmup"] + w["steps"]):
            if step == w["warmup"]:
                eng.call("memory", {"reset_peak": True})
            t = time.perf_counter()
            fb = eng.call("forward_backward", fb_args)
            eng.call("optim_step", {"model_id": "bench", "adam": adam})
            times.append(time.perf_counter() - t)
            losses.append(fb["metrics"]["loss:sum"])
        peak = eng.call("memory", {})["max_allocated_bytes"]
        out[f"engine_train_{kernels}"] = {"ms": 1000 * median(times[w["warmup"]:]), "losses": losses, "peak": peak}
    except BaseException:
        eng.close()
        raise
    return eng


def run_sampling(args: argparse.Namespace, path: Path, w: dict[str, Any], eng: "EngineChannel",
                 out: dict[str, Any]) -> None:
    """Sampling after training (as a deployment does): one batched ``generate`` of a plain copy of
    the base model loaded in this process, against the engine's ways, alternating in every round
    so that drift of the host's speed (the decode steps are bound by kernel launches on the host)
    falls on both; the first round warms up. Per round: 32 distinct prompts as one generate, as one
    sample_batch (the agent's gathered call), as 32 sample calls sent back to back; 1 prompt x 32
    samples as one generate and one sample call."""
    device = torch.device(args.device)
    model = load_plain(path, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.generation_config.pad_token_id = model.config.pad_token_id
    distinct = prompts(w["n"], w["prompt"], w["vocab"], seed=2)
    one = prompts(1, w["prompt"], w["vocab"], seed=3)[0]
    gen_kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=w["new"],
                      min_new_tokens=w["new"])
    reqs = [{"adapter_dir": None, "prompt": p, "num_samples": 1, "sampling_params": sampling_params(w["new"], i),
             "prompt_logprobs": False, "topk_prompt_logprobs": 0, **NO_SCORES} for i, p in enumerate(distinct)]

    def generate(ids: list[list[int]], copies: int) -> float:
        x = torch.tensor(ids, device=device)
        with torch.inference_mode():
            sync(device)
            t = time.perf_counter()
            o = model.generate(input_ids=x, attention_mask=torch.ones_like(x), num_return_sequences=copies,
                               **gen_kwargs)
            sync(device)
        return (o.shape[0] * (o.shape[1] - x.shape[1])) / (time.perf_counter() - t)

    def engine_batch() -> float:
        t = time.perf_counter()
        res = eng.call("sample_batch", {"base_model": "bench", "requests": reqs})
        n_tok = sum(len(s["tokens"]) for r in res["results"] for s in r["result"]["sequences"])
        return n_tok / (time.perf_counter() - t)

    def engine_calls() -> float:
        t = time.perf_counter()
        boxes = [eng.send("sample", {"base_model": "bench", **r}) for r in reqs]
        n_tok = sum(len(s["tokens"]) for b in boxes for s in eng.result(b)["sequences"])
        return n_tok / (time.perf_counter() - t)

    def engine_one() -> float:
        t = time.perf_counter()
        res = eng.call("sample", {"base_model": "bench", "adapter_dir": None, "prompt": one, "num_samples": w["n"],
                                  "sampling_params": sampling_params(w["new"], 7), "prompt_logprobs": False,
                                  "topk_prompt_logprobs": 0, **NO_SCORES})
        return sum(len(s["tokens"]) for s in res["sequences"]) / (time.perf_counter() - t)

    ways = {"generate_distinct": lambda: generate(distinct, 1), "batch": engine_batch, "pipelined": engine_calls,
            "generate_one": lambda: generate([one], w["n"]), "one_prompt": engine_one}
    rounds: dict[str, list[float]] = {k: [] for k in ways}
    for rep in range(1 + w["sample_rounds"]):
        for key, way in ways.items():
            value = way()
            if rep:
                rounds[key].append(value)
    out["sample_rounds"] = rounds
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def fuse_plain(model: Any) -> None:
    """Liger's kernels in a plain Qwen3, as a PEFT user applies them (before get_peft_model)."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3

    apply_liger_kernel_to_qwen3(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False)


def run_plain(args: argparse.Namespace, path: Path, w: dict[str, Any], out: dict[str, Any], kernels: str = "none") -> None:
    from peft import LoraConfig, get_peft_model

    from tinker_engine.losses import target_logprobs  # noqa: F401 - same math, kept for reference
    from tinker_engine.models import init_lora_weights

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    model = load_plain(path, device, dtype)
    if kernels == "liger":
        fuse_plain(model)
    # Training: the same LoRA, the engine's init, bf16 base, fp32 adapter.
    config = LoraConfig(r=w["rank"], lora_alpha=w["rank"], lora_dropout=0.0, bias="none", target_modules=TARGETS)
    peft_model = get_peft_model(model, config)
    named = sorted(((n, p) for n, p in peft_model.named_parameters() if ".lora_" in n), key=lambda kv: kv[0])
    for _, p in named:
        p.data = p.data.float()
    init_lora_weights(named, seed=0)
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    inputs, targets = training_data(w["batch"], w["seq"], w["vocab"])
    inputs, targets = inputs.to(device), targets.to(device)
    losses, times = [], []
    for step in range(w["warmup"] + w["steps"]):
        if step == w["warmup"] and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t = time.perf_counter()
        logits = peft_model(input_ids=inputs, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = -logp.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # one host sync per step, as any training loop logging its loss
        times.append(time.perf_counter() - t)
        del logits, logp, loss
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    out["plain_train" if kernels == "none" else f"plain_train_{kernels}"] = {
        "ms": 1000 * median(times[w["warmup"]:]), "losses": losses, "peak": peak}
    del peft_model, model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def report(args: argparse.Namespace, w: dict[str, Any], out: dict[str, Any]) -> None:
    tokens = w["batch"] * w["seq"]
    flops = model_flops_per_step(MODELS[args.model], w["batch"], w["seq"])
    gib = 2**30
    print(f"\n=== model {args.model} ({args.device}, {torch.__version__}) ===")
    print(f"training: batch {w['batch']} x {w['seq']}, LoRA rank {w['rank']} on {','.join(TARGETS)}, "
          f"{w['steps']} steps after {w['warmup']} warm-up")
    rows = [(k, "plain PEFT" if k == "plain_train" else f"plain PEFT + {k.removeprefix('plain_train_')}")
            for k in out if k.startswith("plain_train")]
    engines = [(k, f"engine ({k.removeprefix('engine_train_')} kernels)") for k in out if k.startswith("engine_train_")]
    for key, label in rows + engines:
        r = out[key]
        secs = r["ms"] / 1000
        mfu = flops / secs / (args.peak_tflops * 1e12) if args.device == "cuda" else float("nan")
        print(f"  {label}: {r['ms']:8.1f} ms/step  {tokens / secs:10.0f} tokens/s  peak {r['peak'] / gib:6.1f} GiB"
              f"  MFU {100 * mfu:5.1f}%")
    for ekey, elabel in engines:
        e = out[ekey]
        for key, label in rows:
            p = out[key]
            rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(e["losses"], p["losses"]))
            print(f"  {elabel} / {label} tokens/s: {p['ms'] / e['ms']:.3f}   max relative loss difference over "
                  f"{len(e['losses'])} steps: {rel:.2e}")
            print(f"    losses {elabel}: {' '.join(f'{x:.4f}' for x in e['losses'][:4])} ...; {label}: "
                  f"{' '.join(f'{x:.4f}' for x in p['losses'][:4])} ...")
    if "sample_rounds" not in out:
        return
    r = out["sample_rounds"]
    med = {k: median(v) for k, v in r.items()}

    def ratios(engine: str, plain: str) -> str:
        per_round = " ".join(f"{e / p:.2f}" for e, p in zip(r[engine], r[plain]))
        return f"{med[engine] / med[plain]:.2f}x (rounds: {per_round})"

    print(f"sampling: prompts of {w['prompt']} tokens, {w['new']} new tokens, temperature 1, tokens/s, median of "
          f"{w['sample_rounds']} alternating rounds after one warm-up")
    print(f"  {w['n']} distinct prompts: generate {med['generate_distinct']:7.0f} | engine sample_batch "
          f"{med['batch']:7.0f} {ratios('batch', 'generate_distinct')}")
    print(f"  {w['n']} distinct prompts: generate {med['generate_distinct']:7.0f} | engine {w['n']} sample calls "
          f"{med['pipelined']:7.0f} {ratios('pipelined', 'generate_distinct')}")
    print(f"  1 prompt x {w['n']} samples: generate {med['generate_one']:7.0f} | engine {med['one_prompt']:7.0f} "
          f"{ratios('one_prompt', 'generate_one')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["1.7b", "8b"], default="1.7b")
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions on the CPU (smoke test)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    ap.add_argument("--sample-rounds", type=int, default=3, help="alternating sampling rounds after a warm-up")
    ap.add_argument("--keep", help="write the model here and keep it (default: a temporary directory)")
    ap.add_argument("--kernels", default="none", help="engine runs, in order: comma-separated TB_ENGINE_KERNELS (none / liger)")
    ap.add_argument("--plain-kernels", default="none", help="plain runs, in order: comma-separated none / liger")
    ap.add_argument("--batch", type=int, default=8, help="datums per step (GPU)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per datum (GPU)")
    args = ap.parse_args()
    if args.tiny:
        args.model, args.device = "tiny", "cpu"
        w = dict(batch=2, seq=64, rank=4, steps=3, warmup=1, n=4, prompt=16, new=8, sample_rounds=args.sample_rounds)
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device; use --tiny for the CPU smoke test")
        args.device = "cuda"
        w = dict(batch=args.batch, seq=args.seq, rank=32, steps=args.steps, warmup=2, n=32, prompt=128, new=128,
                 sample_rounds=args.sample_rounds)
    w["vocab"] = MODELS[args.model]["vocab_size"]
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tb-bench-") as tmp:
        path = Path(args.keep or Path(tmp) / f"qwen3-{args.model}-random")
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        if not (path / "config.json").exists():
            write_model(args.model, path, torch.device(args.device), dtype)
        print(f"model written in {time.perf_counter() - t0:.0f} s", flush=True)
        for kernels in args.plain_kernels.split(","):
            run_plain(args, path, w, out, kernels)
            print(f"plain ({kernels} kernels) done at {time.perf_counter() - t0:.0f} s", flush=True)
        kinds = args.kernels.split(",")
        for kernels in kinds[:-1]:
            run_engine(args, path, w, out, kernels).close()
            print(f"engine ({kernels} kernels) done at {time.perf_counter() - t0:.0f} s", flush=True)
        eng = run_engine(args, path, w, out, kinds[-1])
        print(f"engine ({kinds[-1]} kernels) training done at {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            if args.sample_rounds > 0:
                run_sampling(args, path, w, eng, out)
        finally:
            eng.close()
        print(f"sampling done at {time.perf_counter() - t0:.0f} s", flush=True)
    report(args, w, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
