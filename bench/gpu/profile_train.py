"""Where a training step's time goes in the torch engine, in-process (no channel), on a CUDA machine.

    python bench/gpu/profile_train.py --model 1.7b [--steps 3] [--batch 8] [--seq 1024] [--sample] [--ab N]
    python bench/gpu/profile_train.py --model 1.7b --members 1,2,4,8 [--batch 2] [--seq 256] [--steps 10]

Builds the same random-initialised Qwen3-shaped model as engine_vs_plain.py, creates the same
LoRA (rank 32 on all linear layers and lm_head), and runs forward_backward + optim_step through
the engine's own functions. Prints per-phase wall times (each phase followed by a device sync, so
they add up to the step), then a torch.profiler table of the ops with the most CUDA time and of the
ops with the most CPU self time, and the number of device->host synchronisations per step.

With ``--sample`` it also profiles sampling (after the training steps, as in engine_vs_plain.py):
``sample_batch`` of 32 distinct 128-token prompts x 64 new tokens in-process against one batched
HF ``generate`` of the same prompts on the same (PEFT-wrapped) model, with ms per decode step,
the GPU's busy fraction and the ops with the most CPU self time.

With ``--members N,...`` it measures co-batching instead (issue 34; bench/grouped_lora.py, the same on
the CPU): per N, N models with the same LoRA, each --batch datums of --seq tokens, their N
forward_backward ops one after another against one forward_backward_group of the N, with the
grouped LoRA product and with each adapter on its own: median ms over --steps alternating rounds and
cudaLaunchKernel per pass; then the ops with the most CPU self time in the largest group's pass.

``--cudnn-attention on`` lets SDPA use cuDNN's attention, as torch does by default on compute
capability 9 and 10 (the engine leaves it out since 2026-12-07: TB_ENGINE_CUDNN_ATTENTION); the
default ``off`` is the engine's way. Both in one device call give the change's effect on training.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import engine_vs_plain as evp  # noqa: E402  (sets up the engine's import path too)

from tinker_engine.channel import decode_frame, encode_frame  # noqa: E402
from tinker_engine.device import Placement  # noqa: E402
from tinker_engine.engine import Engine  # noqa: E402


def timed(label: str, fn, times: dict[str, list[float]]):  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    times.setdefault(label, []).append(1000 * (time.perf_counter() - t))
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["1.7b", "8b"], default="1.7b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="datums per step (default 8)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per datum (default 1024)")
    ap.add_argument("--sample", action="store_true", help="also profile sample_batch against generate")
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="then N alternating rounds, in this process on the same model: the plain PEFT step against "
                         "the engine's ops, and their parts (see ab_rounds)")
    ap.add_argument("--optim-parts", type=int, default=0, metavar="N",
                    help="then N rounds timing each part of the engine's optim_step (see optim_parts)")
    ap.add_argument("--members", default="", metavar="N,...",
                    help="co-batching instead: forward_backward_group of N models at --batch x --seq each, per N "
                         "(see the docstring)")
    ap.add_argument("--cudnn-attention", choices=["on", "off"], default="off",
                    help="SDPA may use cuDNN's attention (torch's default order) or not (the engine's default)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    torch.backends.cuda.enable_cudnn_sdp(args.cudnn_attention == "on")
    print(f"cuDNN attention {args.cudnn_attention}", flush=True)
    w = dict(batch=args.batch, seq=args.seq, rank=32, vocab=evp.MODELS[args.model]["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="tb-prof-") as tmp:
        path = Path(tmp) / "model"
        evp.write_model(args.model, path, torch.device("cuda"), torch.bfloat16)
        eng = Engine(Placement(device=torch.device("cuda"), dtype=torch.bfloat16))
        eng.call("load_base", {"name": "b", "path": str(path)})
        if args.members:
            profile_group(eng, [int(n) for n in args.members.split(",")], w["batch"], w["seq"], w["rank"], args.steps)
            return 0
        eng.call("create_model", {"model_id": "m", "base_model": "b", "lora": {
            "rank": w["rank"], "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}})
        inputs, targets = evp.training_data(w["batch"], w["seq"], w["vocab"])
        data = evp.engine_datums(inputs, targets)
        wire = encode_frame({"id": 1, "op": "forward_backward", "args": {"data": data}})[4:]
        fb_args = {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False}
        adam = {"model_id": "m", "adam": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                                                  "weight_decay": 0.0, "grad_clip_norm": 0.0}}
        times: dict[str, list[float]] = {}

        def step() -> None:
            parsed = timed("frame decode of the request", lambda: decode_frame(bytearray(wire))["args"]["data"], times)
            r = timed("forward_backward op", lambda: eng.call("forward_backward", {**fb_args, "data": parsed}), times)
            timed("frame encode of the result", lambda: encode_frame({"id": 1, "ok": True, "result": r}), times)
            timed("optim_step op", lambda: eng.call("optim_step", adam), times)

        for _ in range(2):
            step()
        times.clear()
        for _ in range(args.steps):
            step()
        print(f"=== {args.model}, {w['batch']} x {w['seq']} tokens: phases, ms (median of {args.steps}) ===")
        total = 0.0
        for k, v in times.items():
            m = sorted(v)[len(v) // 2]
            total += m
            print(f"  {k:32s} {m:8.1f}")
        print(f"  {'sum':32s} {total:8.1f}")

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        syncs = sum(e.count for e in ka if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"))
        d2h = sum(e.count for e in ka if e.key in ("aten::item", "aten::_local_scalar_dense"))
        print(f"host syncs in one step: cuda*Synchronize {syncs}, item/_local_scalar_dense {d2h}")
        if args.ab:
            ab_rounds(eng, parsed_data(wire), fb_args, adam, args.ab)
        if args.optim_parts:
            optim_parts(eng, parsed_data(wire), fb_args, args.optim_parts)
        if args.sample:
            profile_sampling(eng, w["vocab"])
    return 0


def profile_group(eng: Engine, members: list[int], datums: int, seq: int, rank: int, rounds: int) -> None:
    """bench/grouped_lora.py's table on this model, then the largest group's pass under torch.profiler."""
    sys.path.insert(0, str(HERE.parent))
    import grouped_lora as gl
    from torch.profiler import ProfilerActivity, profile

    gl.measure(eng, "b", members, datums, seq, rank, rounds)
    n = max(members)
    grouped = gl.variants(eng, gl.requests(eng, "b", n, datums, seq, rank, eng.registry.base("b").vocab_size))["grouped"]
    grouped()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        grouped()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ka) / 1000
    print(f"=== forward_backward_group of {n}, grouped LoRA: GPU kernels {busy:.1f} ms; ops with the most CPU self time ===")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def parsed_data(wire: bytes) -> list:  # type: ignore[type-arg]
    return decode_frame(bytearray(wire))["args"]["data"]


def ab_rounds(eng: Engine, data: list, fb_args: dict, adam: dict, rounds: int) -> None:  # type: ignore[type-arg]
    """Alternating, on one model and one host (no machine-to-machine drift): the plain PEFT step
    (forward, float32 log-softmax, backward, foreach AdamW, one sync) against the engine's
    forward_backward + optim_step ops, and the parts between them: plain forward/backward with the
    engine's chunked target logprobs; the engine's forward_backward alone; plain's AdamW step alone
    against the engine's optim_step alone. Medians in ms; every variant ends with a device sync."""
    from tinker_engine.logprobs import target_logprobs

    model = eng.registry.model("m")
    base = model.base
    params = model.parameters()
    plain_opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ids = torch.stack([d["tokens"] for d in data]).cuda()
    targets = torch.stack([d["loss_fn_inputs"]["target_tokens"] for d in data]).cuda()

    def plain_fb(chunked: bool) -> None:
        base.activate(model.adapter, trainable=True)
        logits = base.hf(input_ids=ids, use_cache=False).logits
        if chunked:
            logp = target_logprobs(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        else:
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = -logp.sum()
        loss.backward()
        float(loss.detach())

    def plain_opt_step() -> None:
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    # Plain code frees the gradients (set_to_none), so its backward allocates fresh ones; the
    # engine's gradients are views of one flat buffer (flat.py). Before each variant, outside the
    # timing, the gradients are put in the state that variant's first op expects.
    def none() -> None:
        model.base.hf.zero_grad(set_to_none=True)

    def flat() -> None:
        model.flat.attach_grads()

    fb_op = lambda: eng.call("forward_backward", {**fb_args, "data": data})  # noqa: E731
    variants = [
        ("plain step (fwd+bwd+AdamW)", none, lambda: (plain_fb(False), plain_opt_step())),
        ("engine fb + optim_step ops", flat, lambda: (fb_op(), eng.call("optim_step", adam))),
        ("plain fwd+bwd", none, lambda: plain_fb(False)),
        ("plain fwd+bwd, chunked logprobs", none, lambda: plain_fb(True)),
        ("engine forward_backward op", flat, fb_op),
        ("plain AdamW step (after a fb op)", flat, lambda: (fb_op(), plain_opt_step())),
        ("engine optim_step op (after a fb op)", flat, lambda: (fb_op(), eng.call("optim_step", adam))),
    ]
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, setup, fn in variants:
            setup()
            timed(label, fn, times)
    flat()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"=== in-process A/B, {rounds} alternating rounds, median ms ===")
    for k, v in med.items():
        print(f"  {k:40s} {v:8.1f}")
    print(f"  engine ops / plain step: {med['engine fb + optim_step ops'] / med['plain step (fwd+bwd+AdamW)']:.3f}x time")
    fb_only = med["engine forward_backward op"] - med["plain fwd+bwd"]
    opt_only = (med["engine optim_step op (after a fb op)"] - med["plain AdamW step (after a fb op)"])
    print(f"  engine extra: forward_backward {fb_only:+.1f} ms, optim_step {opt_only:+.1f} ms; "
          f"chunked logprobs vs float32 log-softmax {med['plain fwd+bwd, chunked logprobs'] - med['plain fwd+bwd']:+.1f} ms")


def optim_parts(eng: Engine, data: list, fb_args: dict, rounds: int) -> None:  # type: ignore[type-arg]
    """Each part of the engine's optim_step on its own (synced before and after), after a real
    forward_backward, against a foreach AdamW step of the same parameters: median ms."""
    from tinker_engine.rollback import StepUndo, step_max_abs

    model = eng.registry.model("m")
    params = [model.flat.weight]  # what optim_step steps: the adapter as one flat parameter (flat.py)
    opt = model.optimizer
    assert opt is not None
    # Plain's optimizer: foreach AdamW over the ~400 separate LoRA tensors (views of the same memory).
    foreach = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        eng.call("forward_backward", {**fb_args, "data": data})
        timed("undo snapshot (no clipping)", lambda: StepUndo(params, opt, model.undo_buffers, grads_change=False), times)
        timed("undo snapshot (with gradients)", lambda: StepUndo(params, opt, model.undo_buffers, grads_change=True), times)
        timed("gradient norm", lambda: torch.nn.utils.get_total_norm([model.flat.grad]), times)
        timed("fused AdamW step", lambda: opt.step(), times)
        timed("step max-abs", lambda: step_max_abs(params, opt), times)
        timed("foreach AdamW step (plain's)", lambda: foreach.step(), times)
        timed("zero_grad", lambda: model.flat.zero_grad(), times)
    print(f"=== optim_step parts, {rounds} rounds, median ms ===")
    for k, v in times.items():
        print(f"  {k:36s} {sorted(v)[len(v) // 2]:8.2f}")


def profile_sampling(eng: Engine, vocab: int, n: int = 32, prompt: int = 128, new: int = 64) -> None:
    from torch.profiler import ProfilerActivity, profile

    distinct = evp.prompts(n, prompt, vocab, seed=2)
    reqs = [{"adapter_dir": None, "prompt": p, "num_samples": 1, "sampling_params": evp.sampling_params(new, i),
             "prompt_logprobs": False, "topk_prompt_logprobs": 0, **evp.NO_SCORES} for i, p in enumerate(distinct)]
    base = eng.registry.bases["b"]

    def engine_run() -> None:
        eng.call("sample_batch", {"base_model": "b", "requests": reqs})

    ids = torch.tensor(distinct, device="cuda")

    def generate_run() -> None:
        base.activate(None)
        with torch.inference_mode():
            base.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    for label, fn in (("engine sample_batch", engine_run), ("HF generate", generate_run)):
        times: dict[str, list[float]] = {}
        for _ in range(2):
            timed(label, fn, times)
        ms = sorted(times[label])[-1]
        print(f"=== sampling, {label}: {n} prompts x {new} tokens: {ms:.1f} ms, {ms / new:.2f} ms per decode step "
              f"(prefill included), {n * new / ms * 1000:.0f} tok/s ===")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall = 1000 * (time.perf_counter() - t)
        ka = prof.key_averages()
        busy = sum(e.self_device_time_total for e in ka) / 1000
        print(f"  profiled: wall {wall:.1f} ms, GPU kernels {busy:.1f} ms ({100 * busy / wall:.0f}% busy)")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        print(ka.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    sys.exit(main())
