"""Run a Tinker Cookbook recipe, unchanged, against a tinker-broker server, offline.

    python test/e2e/cookbook/run.py <recipe> [--workdir DIR] [key=value ...]
    python test/e2e/cookbook/run.py --list

The recipe's own entry point (``python -m tinker_cookbook.recipes....``) runs as a subprocess
against ``TINKER_BASE_URL`` (default http://127.0.0.1:8000, key ``TINKER_API_KEY`` default
tml-local) with the tiny model, a few steps and small batches, and local data written by
``data.py`` into the working directory (its default: ``var/cookbook``). ``key=value`` arguments
are the recipe's own (chz) arguments and replace the defaults below (``key=`` with no value drops
a default: ``loss_fn=`` runs the recipe with its own default loss, ``stable_reinforce`` in
``rl_loop`` and ``math_rl``); for ``sft_then_rl`` prefix them with ``sft.`` or ``rl.``. The recipe writes its metrics to ``<workdir>/runs/<recipe>/``
(``metrics.jsonl``, ``checkpoints.jsonl``; its console output in ``runs/<recipe>.out``).
``resume_from=<state_path>`` is run.py's own: it starts a recipe that resumes from its log
directory (``rl_loop``, ``sl_loop``) from that saved state, at batch 0. The last line printed is one JSON object:
the commands, the log paths, and every metrics row (without the ``time/`` and ``tokens/`` keys;
NaN and infinities as strings).

Models, by environment: ``COOKBOOK_MODEL`` (the student; default the absolute path of
``models/tiny-qwen3``, which the server serves under that name), ``COOKBOOK_TEACHER`` (default
``tiny-qwen3-teacher``), ``COOKBOOK_TEACHER2`` (the second teacher of ``distill_multi_teacher``;
default the student's base model, served by name), ``COOKBOOK_RENDERER`` (default role_colon).
``sl_loop`` and ``rl_loop`` take no renderer or data argument: they look the model up in the
cookbook's model table, so they run as ``Qwen/Qwen3-8B-Base``, which the server must serve as an alias of the tiny
model (``TB_AGENT_MODELS=models/tiny-qwen3=tiny-qwen3=Qwen/Qwen3-8B-Base,...``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))

import data  # noqa: E402

PY = sys.executable


def _models() -> dict[str, str]:
    model = os.environ.get("COOKBOOK_MODEL") or str(ROOT / "models/tiny-qwen3")
    return {
        "model": model,
        "teacher": os.environ.get("COOKBOOK_TEACHER") or "tiny-qwen3-teacher",
        "teacher2": os.environ.get("COOKBOOK_TEACHER2") or model,
        "renderer": os.environ.get("COOKBOOK_RENDERER") or "role_colon",
    }


def _module(mod: str) -> list[str]:
    return [PY, "-m", mod]


# recipe -> (command prefix, default chz arguments). {model} {teacher} {teacher2} {renderer}
# {workdir} {log_path} are filled in.
RECIPES: dict[str, tuple[list[str], dict[str, str]]] = {
    "chat_sl": (_module("tinker_cookbook.recipes.chat_sl.train"), {
        "model_name": "{model}", "renderer_name": "{renderer}", "dataset": "{workdir}/chat.jsonl",
        "batch_size": "16", "max_steps": "12", "learning_rate": "1e-2", "lr_schedule": "constant",
        "lora_rank": "8", "max_length": "256", "save_every": "0", "eval_every": "0",
        "log_path": "{log_path}", "behavior_if_log_dir_exists": "delete",
    }),
    "sl_loop": (_module("tinker_cookbook.recipes.sl_loop"), {
        "model_name": data.SL_LOOP_MODEL_ALIAS, "batch_size": "16", "max_steps": "8",
        "learning_rate": "1e-2", "lora_rank": "8", "max_length": "256", "save_every": "0",
        "log_path": "{log_path}",
    }),
    "rl_loop": (_module("tinker_cookbook.recipes.rl_loop"), {
        "model_name": data.SL_LOOP_MODEL_ALIAS, "loss_fn": "importance_sampling", "batch_size": "4",
        "group_size": "4", "max_tokens": "8", "learning_rate": "1e-4", "lora_rank": "8", "max_steps": "3",
        "save_every": "0", "log_path": "{log_path}",
    }),
    "math_rl": (_module("tinker_cookbook.recipes.math_rl.train"), {
        "model_name": "{model}", "renderer_name": "{renderer}", "env": "arithmetic",
        "loss_fn": "importance_sampling", "group_size": "4", "groups_per_batch": "4", "max_tokens": "8",
        "learning_rate": "1e-4", "lora_rank": "8", "max_steps": "3", "eval_every": "0", "save_every": "0",
        "log_path": "{log_path}", "behavior_if_log_dir_exists": "delete",
    }),
    "math_rl_ppo": (_module("tinker_cookbook.recipes.math_rl.train"), {
        "model_name": "{model}", "renderer_name": "{renderer}", "env": "arithmetic",
        "loss_fn": "ppo", "compute_post_kl": "True", "group_size": "4", "groups_per_batch": "4",
        "max_tokens": "8", "learning_rate": "1e-4", "lora_rank": "8", "max_steps": "3", "eval_every": "0",
        "save_every": "0", "log_path": "{log_path}", "behavior_if_log_dir_exists": "delete",
    }),
    "dpo": (_module("tinker_cookbook.recipes.preference.dpo.train"), {
        "model_name": "{model}", "renderer_name": "{renderer}", "dataset": "hhh", "batch_size": "8",
        "max_steps": "4", "learning_rate": "1e-3", "max_length": "256", "log_path": "{log_path}",
        "behavior_if_log_dir_exists": "delete",
    }),
    "distill_on_policy": (_module("tinker_cookbook.recipes.distillation.on_policy_distillation"), {
        "model_name": "{model}", "teacher_model": "{teacher}", "renderer_name": "{renderer}",
        "dataset": "deepmath", "group_size": "2", "groups_per_batch": "4", "max_tokens": "8",
        "lora_rank": "8", "learning_rate": "1e-4", "max_steps": "3", "eval_every": "0", "save_every": "0",
        "log_path": "{log_path}", "behavior_if_log_dir_exists": "delete",
    }),
    "distill_multi_teacher": (_module("tinker_cookbook.recipes.distillation.on_policy_multi_teacher"), {
        "model_name": "{model}", "deepmath_teacher_model": "{teacher}", "tulu3_teacher_model": "{teacher2}",
        "renderer_name": "{renderer}", "group_size": "2", "deepmath_groups_per_batch": "2",
        "tulu3_groups_per_batch": "2", "max_tokens": "8", "lora_rank": "8", "learning_rate": "1e-4",
        "max_steps": "3", "eval_every": "0", "save_every": "0", "log_path": "{log_path}",
        "behavior_if_log_dir_exists": "delete",
    }),
    "distill_off_policy_topk": ([PY, str(HERE / "off_policy_topk.py")], {
        "model_name": "{model}", "teacher_model": "{teacher}", "renderer_name": "{renderer}",
        "data": "{workdir}/chat.jsonl", "batch_size": "8", "max_steps": "8", "learning_rate": "1e-2",
        "n_teacher_targets": "20", "log_path": "{log_path}",
    }),
}
# SFT on the arithmetic environment's own prompt, answered concisely or verbosely
# (data.arithmetic_sft_rows): the policy it makes fits its answer in math_rl's max_tokens=10 (and so
# earns the format reward) with probability about 0.7, so most groups of 4 samples have mixed
# rewards; math_rl_from_sft trains math_rl from that state (load_checkpoint_path=<state_path> is the
# caller's). 64 steps of 32: the NLL falls from ln(1029) to about 1.3, and every run is the same
# (fixed data order, deterministic CPU training).
RECIPES["arithmetic_sft"] = (RECIPES["chat_sl"][0], {
    **RECIPES["chat_sl"][1], "dataset": "{workdir}/arithmetic_sft.jsonl", "train_on_what": "last_assistant_message",
    "batch_size": "32", "max_steps": "64", "learning_rate": "5e-3", "lora_rank": "32",
})
RECIPES["math_rl_from_sft"] = (RECIPES["math_rl"][0], {
    **{k: v for k, v in RECIPES["math_rl"][1].items() if k != "loss_fn"}, "groups_per_batch": "8",
    "max_tokens": "10", "learning_rate": "1e-3", "lora_rank": "32", "max_steps": "6",
})
# SFT on rl_loop's own prompts (data.rl_loop_sft_rows: the boxed sum or "No idea.", half and half,
# for the problems of rl_loop's first 6 steps); rl_loop_from_sft runs rl_loop from that state. rl_loop
# has no argument for a start state: it resumes from the last state in <log_path>/checkpoints.jsonl,
# so run.py writes one there (``resume_from=<state_path>``, run.py's own argument, not the recipe's).
RECIPES["rl_loop_sft"] = (RECIPES["chat_sl"][0], {
    **RECIPES["chat_sl"][1], "model_name": data.SL_LOOP_MODEL_ALIAS, "renderer_name": "role_colon",
    "dataset": "{workdir}/rl_loop_sft.jsonl", "train_on_what": "last_assistant_message",
    "batch_size": "16", "max_steps": "48", "learning_rate": "5e-3", "lora_rank": "32",
})
RECIPES["rl_loop_from_sft"] = (RECIPES["rl_loop"][0], {
    **{k: v for k, v in RECIPES["rl_loop"][1].items() if k != "loss_fn"}, "max_tokens": "12",
    "learning_rate": "1e-3", "lora_rank": "32", "max_steps": "6",
})
# SFT, then RL from the SFT run's final state (the two above, in one command).
SFT_THEN_RL = ("arithmetic_sft", "math_rl_from_sft")
ALL = [*RECIPES, "sft_then_rl"]


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(log_path: Path) -> list[dict]:
    rows = []
    f = log_path / "metrics.jsonl"
    if f.exists():
        for line in f.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows.append({k: _finite(v) for k, v in row.items()
                             if not k.startswith(("time/", "tokens/"))})
    return rows


def read_checkpoints(log_path: Path) -> list[dict]:
    f = log_path / "checkpoints.jsonl"
    return [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.exists() else []


def run_one(recipe: str, workdir: Path, overrides: dict[str, str], run_name: str | None = None) -> dict:
    cmd_prefix, defaults = RECIPES[recipe]
    log_path = workdir / "runs" / (run_name or recipe)
    # A recipe resumes from checkpoints it finds in log_path (sl_loop, rl_loop, off-policy): start
    # clean, or from the state named by resume_from (as if the recipe had saved it at batch 0).
    shutil.rmtree(log_path, ignore_errors=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides)
    resume_from = overrides.pop("resume_from", "")
    if resume_from:
        log_path.mkdir()
        record = {"name": "resume_from", "batch": 0, "state_path": resume_from}
        (log_path / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
    fill = {**_models(), "workdir": str(workdir), "log_path": str(log_path)}
    args = {k: v.format(**fill) for k, v in defaults.items()}
    args.update(overrides)
    # `key=` (empty) drops a default, so the recipe uses its own (e.g. loss_fn= runs its default loss).
    args = {k: v for k, v in args.items() if v != ""}
    cmd = [*cmd_prefix, *(f"{k}={v}" for k, v in args.items())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TINKER_BASE_URL": os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"),
           "TINKER_API_KEY": os.environ.get("TINKER_API_KEY", "tml-local"),
           "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    # The recipe's output goes to a file beside its metrics (ml_log writes logs.log there too).
    with open(log_path.parent / f"{log_path.name}.out", "w") as out:
        rc = subprocess.call(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    result = {"recipe": recipe, "cmd": cmd, "cwd": str(workdir), "log_path": str(log_path), "rc": rc,
              "seconds": round(time.time() - t0, 1), "metrics": read_metrics(log_path),
              "checkpoints": read_checkpoints(log_path)}
    if rc != 0:
        tail = (log_path.parent / f"{log_path.name}.out").read_text()[-6000:]
        sys.stderr.write(f"{recipe} failed (exit {rc}): {' '.join(cmd)}\n{tail}\n")
    return result


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("recipes:", ", ".join(ALL))
        return 0 if argv else 2
    if argv[0] == "--list":
        print("\n".join(ALL))
        return 0
    recipe, rest = argv[0], argv[1:]
    if recipe not in ALL:
        sys.stderr.write(f"unknown recipe {recipe!r}; recipes: {', '.join(ALL)}\n")
        return 2
    workdir = ROOT / "var/cookbook"
    overrides: dict[str, str] = {}
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--workdir":
            workdir = Path(rest[i + 1])
            i += 2
            continue
        if a.startswith("--workdir="):
            workdir = Path(a.split("=", 1)[1])
        elif "=" in a:
            k, v = a.split("=", 1)
            overrides[k] = v
        else:
            sys.stderr.write(f"expected key=value, got {a!r}\n")
            return 2
        i += 1
    workdir = workdir.resolve()
    data.prepare(workdir, _models()["model"] if os.path.isdir(_models()["model"]) else ROOT / "models/tiny-qwen3")

    if recipe == "sft_then_rl":
        sft_name, rl_name = SFT_THEN_RL
        sft = run_one(sft_name, workdir, {k[4:]: v for k, v in overrides.items() if k.startswith("sft.")},
                      run_name="sft_then_rl-sft")
        out = {"recipe": recipe, "sft": sft}
        if sft["rc"] == 0:
            state = sft["checkpoints"][-1]["state_path"]
            rl_over = {"load_checkpoint_path": state,
                       **{k[3:]: v for k, v in overrides.items() if k.startswith("rl.")}}
            out["rl"] = run_one(rl_name, workdir, rl_over, run_name="sft_then_rl-rl")
        rc = sft["rc"] or out.get("rl", {}).get("rc", 1)
    else:
        out = run_one(recipe, workdir, overrides)
        rc = out["rc"]
    print(json.dumps(out))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
