"""The SDK side of test/e2e/verl-ranks.test.ts: the real tinker SDK against a stack whose verl agent runs
1, 2 or 4 CPU ranks (test/fixtures/verl-ranks/cpu_verl_ranks.yaml).

Usage: TINKER_BASE_URL=... TINKER_API_KEY=... python verl_ranks_driver.py
Reads one JSON command per stdin line and prints one JSON answer per line (the test starts and stops
agents between commands, so the same SDK process sees each rank count):

  {"cmd": "train", "base": NAME, "save": bool}
      a LoRA (rank 8, seed 0, every target incl. lm_head) trained STEPS steps on BATCH with ADAM:
      "losses" (forward_backward's loss:sum per step), "grad_norms"; with save: save_state and
      save_weights_for_sampler after the last step ("state", "sampler"), the trainer's own logprobs of
      PROBE ("trainer_logprobs", forward on the trainer), and "next" (the losses a resume must reproduce)
  {"cmd": "resume", "state": PATH}
      create_training_client_from_state_with_optimizer(PATH), then "next" as above
  {"cmd": "score", "sampler": PATH, "base": NAME}
      compute_logprobs(PROBE) and prompt logprobs of a one-token sample with the sampler weights at PATH
      ("adapter"), and compute_logprobs of the base model by NAME ("base")
"""

import json
import sys

import numpy as np
import tinker
from tinker import types

STEPS = 4
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
#: A fixed probe sequence (the tiny model's vocabulary is 1029 tokens).
PROBE = [7, 42, 99, 5, 300, 12, 8, 77, 640, 3, 19, 250]


def batch() -> list[types.Datum]:
    """Four datums of different lengths (9..15 tokens), so 2 and 4 ranks get different row layouts
    (2 ranks: rows 0,2 / 1,3; 4 ranks: one each) and padding; the first two positions weigh 0."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(4):
        toks = rng.integers(1, 1000, size=10 + 2 * i).tolist()
        weights = np.ones(len(toks) - 1, dtype=np.float32)
        weights[:2] = 0.0
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": np.array(toks[1:], dtype=np.int64), "weights": weights}))
    return out


def probe_datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(PROBE[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(PROBE[1:], dtype=np.int64)})


def train_step(tc) -> tuple[float, float | None]:
    fb = tc.forward_backward(batch(), "cross_entropy")
    opt = tc.optim_step(ADAM)
    loss = float(fb.result().metrics["loss:sum"])
    metrics = getattr(opt.result(), "metrics", None) or {}
    norm = metrics.get("grad_norm")
    return loss, None if norm is None else float(norm)


def next_losses(tc) -> list[float]:
    """What a resumed client must reproduce: the forward loss now, one more step's loss, and the forward loss after it."""
    before = float(tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"])
    step_loss, _ = train_step(tc)
    after = float(tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"])
    return [before, step_loss, after]


def to_list(x) -> list[float]:
    return [float(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def main() -> None:
    svc = tinker.ServiceClient()
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict = {"cmd": cmd["cmd"]}
        try:
            if cmd["cmd"] == "train":
                tc = svc.create_lora_training_client(base_model=cmd["base"], rank=8, seed=0)
                losses, norms = [], []
                for _ in range(STEPS):
                    loss, norm = train_step(tc)
                    losses.append(loss)
                    norms.append(norm)
                out.update(losses=losses, grad_norms=norms)
                if cmd.get("save"):
                    out["state"] = tc.save_state("ranks-state").result().path
                    out["sampler"] = tc.save_weights_for_sampler("ranks-sampler").result().path
                    fwd = tc.forward([probe_datum()], "cross_entropy").result()
                    out["trainer_logprobs"] = to_list(fwd.loss_fn_outputs[0]["logprobs"].to_numpy())
                    out["next"] = next_losses(tc)
            elif cmd["cmd"] == "resume":
                tc = svc.create_training_client_from_state_with_optimizer(cmd["state"])
                out["next"] = next_losses(tc)
            elif cmd["cmd"] == "score":
                sc = svc.create_sampling_client(model_path=cmd["sampler"])
                prompt = types.ModelInput.from_ints(PROBE)
                out["adapter"] = [float(v) for v in sc.compute_logprobs(prompt).result()[1:]]
                res = sc.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0), include_prompt_logprobs=True).result()
                out["adapter_prompt"] = [float(v) for v in res.prompt_logprobs[1:]]
                base = svc.create_sampling_client(base_model=cmd["base"])
                out["base"] = [float(v) for v in base.compute_logprobs(prompt).result()[1:]]
            else:
                raise ValueError(f"unknown command {cmd['cmd']}")
        except Exception as e:  # noqa: BLE001 - the test prints what the SDK raised
            out["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
