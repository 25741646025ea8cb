"""verl engine vs torch engine, both driven over their stdio channels (protocol 2).

Run by bench/gpu/verl_check.sh on the H200 (see there); ``--cpu`` runs it here with the tiny model,
and the verl engine replaced by a second torch engine (``--twin``), to check the driver itself.

1. builds a random-initialised Qwen3 model (Qwen3-0.6B dimensions by default, no hub) with the tiny
   tokenizer of scripts/make_tiny_model.py;
2. starts the torch engine (``python -m tinker_engine``) and the verl engine (torchrun ...
   ``-m tinker_engine_verl``), same base, same LoRA (rank, seed, targets);
3. step 0 forward_only logprobs; N steps of cross_entropy + optim_step (every AdamParams field,
   grad clipping on odd steps); one importance_sampling step; forward_only ppo / cispo / dro;
   per-step losses side by side with relative differences;
4. sampler adapters of both engines compared tensor by tensor; prompt logprobs scored by the torch
   engine from the verl checkpoint (load_state) and by transformers+PEFT from verl's sampler
   adapter, against the torch engine's own model;
5. save_state with optimizer from verl, loaded by the torch engine, and the other way round;
6. writes summary.json, verl_fixtures.json (the verl translation's real inputs/outputs, for
   test/fixtures/verl/) and both engines' logs into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
PY_DIR = REPO / "workers" / "python"
sys.path.insert(0, str(PY_DIR))

from tinker_engine.channel import decode_frame, encode_frame  # noqa: E402


# --- a protocol v2 client ------------------------------------------------------------------------


class EngineClient:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env, cwd=str(REPO))
        self.next_id = 1

    def call(self, op: str, args: dict[str, Any] | None = None, ok: bool = True) -> dict[str, Any]:
        frame = encode_frame({"id": self.next_id, "op": op, "args": args or {}})
        self.next_id += 1
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(frame)
        self.proc.stdin.flush()
        head = self.proc.stdout.read(4)
        if len(head) < 4:
            raise RuntimeError(f"{self.name}: engine exited during {op}; log tail:\n{self.tail()}")
        (n,) = struct.unpack(">I", head)
        reply = decode_frame(bytearray(self.proc.stdout.read(n)))
        if ok and not reply.get("ok"):
            raise RuntimeError(f"{self.name}: {op} failed: {reply.get('error')}\nlog tail:\n{self.tail()}")
        return reply["result"] if reply.get("ok") else reply

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# --- model and data ------------------------------------------------------------------------------


DIMS = {
    # Qwen3-0.6B
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def build_model(out: Path, dims: str, device: str, seed: int) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    mtm = importlib.util.module_from_spec(spec)
    sys.modules["make_tiny_model"] = mtm
    spec.loader.exec_module(mtm)
    if dims == "tiny":
        return mtm.make_tiny_model(out / "tiny")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = out / f"qwen3-{dims}-random"
    tok = mtm.build_tokenizer(mtm.TinySpec())
    config = Qwen3Config(**DIMS[dims], bos_token_id=None,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    return path


def tensor(values: list[float] | torch.Tensor, dtype: str = "float32") -> dict[str, Any]:
    t = torch.as_tensor(values)
    return {"dtype": dtype, "shape": list(t.shape), "data": t.reshape(-1).tolist()}


def make_data(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        seqs.append(torch.randint(0, vocab, (length + 1,), generator=gen).tolist())
    return seqs


def ce_datum(seq: list[int]) -> dict[str, Any]:
    n = len(seq) - 1
    weights = [0.0] * (n // 3) + [1.0] * (n - n // 3)  # a prompt part with weight 0, then the completion
    return {"tokens": tensor(seq[:-1], "int64"), "loss_fn_inputs": {"target_tokens": tensor(seq[1:], "int64"),
                                                                    "weights": tensor(weights)}}


def rl_datum(seq: list[int], q: list[float], seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    n = len(seq) - 1
    adv = (torch.randn(n, generator=gen)).tolist()
    q_noisy = (torch.tensor(q) + 0.05 * torch.randn(n, generator=gen)).tolist()
    return {"tokens": tensor(seq[:-1], "int64"), "loss_fn_inputs": {"target_tokens": tensor(seq[1:], "int64"),
                                                                    "logprobs": tensor(q_noisy), "advantages": tensor(adv)}}


def logprobs_of(result: dict[str, Any]) -> list[torch.Tensor]:
    return [o["logprobs"] for o in result["loss_fn_outputs"]]


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


# --- the check -----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/verl_check_out"))
    ap.add_argument("--work", default="/tmp/verl_check_work")
    ap.add_argument("--cpu", action="store_true", help="tiny model on CPU, the verl engine replaced by a torch twin")
    ap.add_argument("--dims", default=None, help="0.6b (default on GPU) or tiny (default with --cpu)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--unembed", action="store_true", help="also train lm_head (Tinker's default)")
    args = ap.parse_args()
    dims = args.dims or ("tiny" if args.cpu else "0.6b")
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    device = "cpu" if args.cpu else "cuda"
    summary: dict[str, Any] = {"dims": dims, "device": device, "steps": [], "checks": {}, "errors": []}
    t0 = time.perf_counter()

    model_dir = build_model(work, dims, device, seed=0)
    print(f"[model] {model_dir} built in {time.perf_counter() - t0:.1f}s", flush=True)
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PY_DIR), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "4"}
    torch_env = {**env, "TB_ENGINE_DEVICE": "cpu" if args.cpu else "cuda:0"}
    fixtures_dir = work / "fixtures"
    if args.cpu:
        verl_argv = [sys.executable, "-m", "tinker_engine"]
        verl_env = {**torch_env}
    else:
        verl_argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                     "-m", "tinker_engine_verl"]
        verl_env = {**env, "TB_VERL_RECORD": str(fixtures_dir)}
    te = EngineClient("torch", [sys.executable, "-m", "tinker_engine"], torch_env, out / "torch_engine.log")
    ve = EngineClient("twin" if args.cpu else "verl", verl_argv, verl_env, out / "verl_engine.log")
    try:
        for eng in (te, ve):
            t = time.perf_counter()
            print(f"[{eng.name}] hello {eng.call('hello')} in {time.perf_counter() - t:.1f}s", flush=True)
            print(f"[{eng.name}] load_base {eng.call('load_base', {'name': 'base', 'path': str(model_dir)})}", flush=True)
        lora = {"rank": args.rank, "seed": 7, "train_attn": True, "train_mlp": True, "train_unembed": args.unembed}
        for eng in (te, ve):
            t = time.perf_counter()
            eng.call("create_model", {"model_id": "m", "base_model": "base", "lora": lora})
            print(f"[{eng.name}] create_model {lora} in {time.perf_counter() - t:.1f}s", flush=True)

        seqs = make_data(args.batch, args.min_len, args.max_len, vocab, seed=1)
        ce = [ce_datum(s) for s in seqs]

        def fb(eng: EngineClient, loss_fn: str, data: list[dict[str, Any]], forward_only: bool = False,
               config: dict[str, Any] | None = None, model_id: str = "m") -> tuple[dict[str, Any], float]:
            t = time.perf_counter()
            r = eng.call("forward_backward", {"model_id": model_id, "loss_fn": loss_fn, "loss_fn_config": config or {},
                                              "forward_only": forward_only, "data": data})
            return r, (time.perf_counter() - t) * 1000

        # step 0: the same init must give the same logprobs
        r_t, _ = fb(te, "cross_entropy", ce, forward_only=True)
        r_v, _ = fb(ve, "cross_entropy", ce, forward_only=True)
        d0 = max_abs(logprobs_of(r_t), logprobs_of(r_v))
        summary["checks"]["step0_logprobs_max_abs_diff"] = d0
        print(f"[step0] forward_only loss torch={r_t['metrics']['loss:sum']:.6f} verl={r_v['metrics']['loss:sum']:.6f} "
              f"rel={rel(r_t['metrics']['loss:sum'], r_v['metrics']['loss:sum']):.2e} max|dlp|={d0:.4f}", flush=True)

        adams = []
        for step in range(args.steps):
            adams.append({"learning_rate": 2e-4 * (1 + step), "beta1": 0.9, "beta2": 0.95 if step % 2 else 0.99,
                          "eps": 1e-8, "weight_decay": 0.01 * step, "grad_clip_norm": 1.0 if step % 2 else 0.0})
        print(f"{'step':>4} {'loss torch':>14} {'loss verl':>14} {'rel diff':>9} {'gnorm torch':>12} {'gnorm verl':>12} "
              f"{'ms torch':>9} {'ms verl':>9}", flush=True)

        def train_step(step: int | str, loss_fn: str, data_t: list, data_v: list, adam: dict[str, Any]) -> None:
            r_t, ms_t = fb(te, loss_fn, data_t)
            r_v, ms_v = fb(ve, loss_fn, data_v)
            o_t = te.call("optim_step", {"model_id": "m", "adam": adam})
            o_v = ve.call("optim_step", {"model_id": "m", "adam": adam})
            lt, lv = r_t["metrics"]["loss:sum"], r_v["metrics"]["loss:sum"]
            gt, gv = o_t["metrics"]["grad_norm"], o_v["metrics"]["grad_norm"]
            row = {"step": step, "loss_fn": loss_fn, "loss_torch": lt, "loss_verl": lv, "rel": rel(lt, lv),
                   "grad_norm_torch": gt, "grad_norm_verl": gv, "grad_norm_rel": rel(gt, gv),
                   "logprobs_max_abs_diff": max_abs(logprobs_of(r_t), logprobs_of(r_v)), "ms_torch": ms_t,
                   "ms_verl": ms_v, "adam": adam}
            summary["steps"].append(row)
            print(f"{str(step):>4} {lt:14.6f} {lv:14.6f} {row['rel']:9.2e} {gt:12.5f} {gv:12.5f} {ms_t:9.0f} {ms_v:9.0f}",
                  flush=True)

        for step in range(args.steps):
            train_step(step, "cross_entropy", ce, ce, adams[step])

        # importance sampling: sampler logprobs = the torch engine's current ones, perturbed
        r_q, _ = fb(te, "cross_entropy", ce, forward_only=True)
        qs = [lp.tolist() for lp in logprobs_of(r_q)]
        rl = [rl_datum(s, q, seed=100 + i) for i, (s, q) in enumerate(zip(seqs, qs))]
        train_step("IS", "importance_sampling", rl, rl,
                   {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                    "grad_clip_norm": 0.0})
        for loss_fn, config in (("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("cispo", {}),
                                ("dro", {"beta": 0.1})):
            a, _ = fb(te, loss_fn, rl, forward_only=True, config=config)
            b, _ = fb(ve, loss_fn, rl, forward_only=True, config=config)
            la, lb = a["metrics"]["loss:sum"], b["metrics"]["loss:sum"]
            summary["checks"][f"{loss_fn}_forward_only"] = {"torch": la, "verl": lb, "rel": rel(la, lb)}
            print(f"[{loss_fn}] forward_only loss torch={la:.6f} verl={lb:.6f} rel={rel(la, lb):.2e}", flush=True)

        # adapters after training, tensor by tensor
        from safetensors.torch import load_file

        sam_t, sam_v = work / "sampler_torch", work / "sampler_verl"
        te.call("save_sampler", {"model_id": "m", "dir": str(sam_t)})
        ve.call("save_sampler", {"model_id": "m", "dir": str(sam_v)})
        wt, wv = load_file(str(sam_t / "adapter_model.safetensors")), load_file(str(sam_v / "adapter_model.safetensors"))
        same_keys = sorted(wt) == sorted(wv)
        diffs = {k: float((wt[k] - wv[k]).abs().max()) for k in wt if k in wv}
        scale = max(float(wt[k].abs().max()) for k in wt)
        worst = max(diffs, key=diffs.get) if diffs else None
        summary["checks"]["adapter"] = {"same_keys": same_keys, "n_tensors": len(wt), "max_abs_diff": diffs.get(worst),
                                        "worst": worst, "max_abs_value": scale,
                                        "config_torch": json.loads((sam_t / "adapter_config.json").read_text()),
                                        "config_verl": json.loads((sam_v / "adapter_config.json").read_text())}
        print(f"[adapter] same keys={same_keys} tensors={len(wt)} max|dW|={diffs.get(worst)} ({worst}) max|W|={scale:.4f}",
              flush=True)

        # prompt logprobs: the torch engine from verl's checkpoint vs its own model
        prompts = [s[: min(len(s), 128)] for s in make_data(4, 32, 128, vocab, seed=9)]
        pdata = [{"tokens": tensor(p[:-1], "int64"), "loss_fn_inputs": {"target_tokens": tensor(p[1:], "int64")}} for p in prompts]
        ck_v, ck_t = work / "ckpt_verl", work / "ckpt_torch"
        ve.call("save_state", {"model_id": "m", "dir": str(ck_v), "optimizer": True})
        te.call("save_state", {"model_id": "m", "dir": str(ck_t), "optimizer": True})
        te.call("create_model", {"model_id": "from_verl", "base_model": "base", "lora": {**lora, "seed": 99}})
        te.call("load_state", {"model_id": "from_verl", "dir": str(ck_v), "optimizer": True})
        own, _ = fb(te, "cross_entropy", pdata, forward_only=True)
        via, _ = fb(te, "cross_entropy", pdata, forward_only=True, model_id="from_verl")
        dv = max_abs(logprobs_of(own), logprobs_of(via))
        summary["checks"]["prompt_logprobs_torch_from_verl_ckpt_max_abs_diff"] = dv
        print(f"[prompt-logprobs] torch engine: own model vs verl checkpoint max|dlp|={dv:.4f}", flush=True)
        ot, ov = load_file(str(ck_t / "optimizer.safetensors")), load_file(str(ck_v / "optimizer.safetensors"))
        summary["checks"]["optimizer_state"] = {
            "same_keys": sorted(ot) == sorted(ov),
            "exp_avg_sq_max_rel": max((float(((ot[k] - ov[k]).abs().max()) / (ot[k].abs().max() + 1e-30)))
                                      for k in ot if k.startswith("exp_avg_sq/") and k in ov),
            "steps_torch": json.loads((ck_t / "optimizer.json").read_text())["step"].get(worst or "", None),
            "steps_verl": json.loads((ck_v / "optimizer.json").read_text())["step"].get(worst or "", None),
            "hyper_torch": json.loads((ck_t / "optimizer.json").read_text())["hyperparameters"],
            "hyper_verl": json.loads((ck_v / "optimizer.json").read_text())["hyperparameters"]}
        print(f"[optimizer-state] {summary['checks']['optimizer_state']}", flush=True)

        # the other direction: verl loads the torch engine's checkpoint (with optimizer), both take one more step
        ve.call("load_state", {"model_id": "m", "dir": str(ck_t), "optimizer": True})
        train_step("resume", "cross_entropy", ce, ce, adams[0])

        # sampling side: transformers + PEFT from verl's sampler adapter (as vLLM would load it)
        try:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            dt = torch.float32 if args.cpu else torch.bfloat16
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(device).eval()
            peft_model = PeftModel.from_pretrained(base, str(sam_v)).eval()
            got = []
            with torch.no_grad():
                for p in prompts:
                    logits = peft_model(input_ids=torch.tensor([p[:-1]], device=device)).logits[0].float()
                    got.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(p[1:], device=device)[:, None])
                               .squeeze(-1).cpu())
            dp = max_abs(got, logprobs_of(via))  # the torch engine on verl's checkpoint: the same weights
            dp_own = max_abs(got, logprobs_of(own))  # the torch engine's own trained model
            summary["checks"]["prompt_logprobs_peft_verl_adapter_vs_torch_engine_same_weights_max_abs_diff"] = dp
            summary["checks"]["prompt_logprobs_peft_verl_adapter_vs_torch_own_model_max_abs_diff"] = dp_own
            print(f"[prompt-logprobs] transformers+PEFT from verl's sampler adapter vs torch engine on verl's "
                  f"checkpoint max|dlp|={dp:.4f}; vs the torch engine's own model max|dlp|={dp_own:.4f}", flush=True)
            del peft_model, base
        except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
            summary["errors"].append(f"peft scoring: {type(exc).__name__}: {exc}")
            print(f"[prompt-logprobs] PEFT scoring failed: {exc}", flush=True)

        # the torch engine's sample op on verl's adapter (prompt logprobs); transformers 5.17 may refuse
        r = te.call("sample", {"base_model": "base", "adapter_dir": str(sam_v), "prompt": prompts[0], "num_samples": 1,
                               "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_k": -1, "top_p": 1.0,
                                                   "seed": 0, "stop_tokens": [], "stop_strings": [],
                                                   "stop_at_eos": True},
                               "prompt_logprobs": True, "topk_prompt_logprobs": 0, "target_prompt_logprobs": None,
                               "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0}, ok=False)
        if isinstance(r, dict) and r.get("ok") is False:
            summary["checks"]["torch_sample_from_verl_adapter"] = f"failed: {r['error']}"
        else:
            pl = torch.tensor(r["prompt_logprobs"][1:])
            summary["checks"]["torch_sample_from_verl_adapter"] = {
                "prompt_logprobs_max_abs_diff_vs_forward": float((pl - logprobs_of(via)[0]).abs().max())}
        print(f"[sample] torch engine sample() with verl's adapter: {summary['checks']['torch_sample_from_verl_adapter']}",
              flush=True)

        # errors stay errors: non-next-token targets and sample on the verl engine
        bad = {"tokens": tensor([1, 2, 3], "int64"), "loss_fn_inputs": {"target_tokens": tensor([2, 9, 4], "int64")}}
        e1 = ve.call("forward_backward", {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {},
                                          "forward_only": True, "data": [bad]}, ok=False)
        summary["checks"]["verl_rejects_non_next_token_targets"] = e1 if not args.cpu else "n/a (twin)"
        print(f"[errors] non-next-token targets on verl: {summary['checks']['verl_rejects_non_next_token_targets']}",
              flush=True)
        # LoRA on lm_head too (Tinker's default train_unembed=True; the model ties its embeddings)
        if not args.unembed:
            try:
                ul = {**lora, "train_unembed": True}
                for eng in (te, ve):
                    eng.call("unload_model", {"model_id": "from_verl" if eng is te else "m"})
                    eng.call("create_model", {"model_id": "u", "base_model": "base", "lora": ul})
                a, _ = fb(te, "cross_entropy", ce, model_id="u")
                b, _ = fb(ve, "cross_entropy", ce, model_id="u")
                ga = te.call("optim_step", {"model_id": "u", "adam": adams[-1]})["metrics"]["grad_norm"]
                gb = ve.call("optim_step", {"model_id": "u", "adam": adams[-1]})["metrics"]["grad_norm"]
                su = work / "sampler_verl_unembed"
                ve.call("save_sampler", {"model_id": "u", "dir": str(su)})
                keys = [k for k in load_file(str(su / "adapter_model.safetensors")) if "lm_head" in k]
                la, lb = a["metrics"]["loss:sum"], b["metrics"]["loss:sum"]
                summary["checks"]["unembed"] = {"loss_torch": la, "loss_verl": lb, "rel": rel(la, lb),
                                                "grad_norm_torch": ga, "grad_norm_verl": gb, "lm_head_keys": keys}
                print(f"[unembed] lm_head LoRA: loss torch={la:.6f} verl={lb:.6f} rel={rel(la, lb):.2e} "
                      f"gnorm {ga:.5f}/{gb:.5f} adapter lm_head keys={keys}", flush=True)
            except Exception as exc:  # noqa: BLE001 - reported; the main check stands
                summary["checks"]["unembed"] = f"failed: {type(exc).__name__}: {exc}"[:2000]
                print(f"[unembed] failed: {exc}"[:2000], flush=True)
        # small batches for the CI fixtures (the engine records requests of <= 512 tokens): every loss
        try:
            mid = "u" if isinstance(summary["checks"].get("unembed"), dict) else "m"
            small = make_data(3, 4, 12, vocab, seed=21)
            sce = [ce_datum(s) for s in small]
            r_small, _ = fb(te, "cross_entropy", sce, forward_only=True)
            srl = [rl_datum(s, lp.tolist(), seed=200 + i) for i, (s, lp) in enumerate(zip(small, logprobs_of(r_small)))]
            for loss_fn, data, fo, config in (("cross_entropy", sce, True, {}), ("cross_entropy", sce, False, {}),
                                              ("importance_sampling", srl, False, {}),
                                              ("ppo", srl, True, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
                                              ("cispo", srl, True, {}), ("dro", srl, True, {"beta": 0.2})):
                fb(ve, loss_fn, data, forward_only=fo, config=config, model_id=mid)
            print(f"[fixtures] 6 small forward_backward calls on the verl engine (model {mid})", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported
            summary["errors"].append(f"fixture pass: {type(exc).__name__}: {exc}"[:2000])
            print(f"[fixtures] failed: {exc}"[:2000], flush=True)
    except Exception as exc:  # noqa: BLE001 - print what ran, then fail
        summary["errors"].append(f"{type(exc).__name__}: {exc}")
        print(f"[FAILED] {type(exc).__name__}: {exc}", flush=True)
    finally:
        te.close()
        ve.close()
        summary["wall_s"] = time.perf_counter() - t0
        bundle = []
        if fixtures_dir.is_dir():
            bundle = [json.loads(p.read_text()) | {"name": p.stem} for p in sorted(fixtures_dir.glob("fb_*.json"))]
        if bundle:
            (out / "verl_fixtures.json").write_text(json.dumps({"format": 1, "fixtures": bundle}))
        summary["fixtures"] = [f["name"] for f in bundle]
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        steps = summary["steps"]
        if steps:
            print(f"[summary] max rel loss diff over {len(steps)} steps: {max(s['rel'] for s in steps):.2e}; "
                  f"max rel grad-norm diff: {max(s['grad_norm_rel'] for s in steps):.2e}; "
                  f"mean ms/step (fb) torch {sum(s['ms_torch'] for s in steps) / len(steps):.0f} "
                  f"verl {sum(s['ms_verl'] for s in steps) / len(steps):.0f}", flush=True)
        print(f"[summary] fixtures written: {len(bundle)}; errors: {summary['errors']}; wall {summary['wall_s']:.0f}s",
              flush=True)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
