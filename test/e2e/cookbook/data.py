"""Local data for running Tinker Cookbook recipes offline against tinker-broker.

Nothing here touches a hub. The cookbook recipes load their data in two ways, and both are
served from files written here:

- an explicit file argument (``chat_sl dataset=<file>.jsonl``): ``chat.jsonl``;
- ``datasets.load_dataset("<org>/<name>")`` with a hard-coded hub id (``sl_loop``'s
  ``HuggingFaceH4/no_robots``, ``rl_loop``'s ``openai/gsm8k`` (config ``main``), DPO's
  ``Anthropic/hh-rlhf``, distillation's ``zwhe99/DeepMath-103K`` and
  ``allenai/tulu-3-sft-mixture``): ``datasets`` resolves an id that names an existing local
  directory to that directory before it asks any hub, so a recipe run with this working
  directory reads ``<workdir>/<org>/<name>/{train,test}.jsonl``. The records have the fields the
  recipes read, in the hub datasets' shapes.

``sl_loop`` and ``rl_loop`` also look their model up in the cookbook's model table
(``model_info``), which knows only hub names; ``Qwen/Qwen3-8B-Base`` (a Qwen3 base model: renderer
``role_colon``) is made a link to the tiny model, so ``get_tokenizer("Qwen/Qwen3-8B-Base")`` loads
the tiny tokenizer from the working directory. The server must then serve the tiny model under
that name too (an alias).

All content is small arithmetic chat, which the tiny model's tokenizer was trained on.

    python test/e2e/cookbook/data.py <workdir> [--model models/tiny-qwen3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

# The hub name sl_loop is run with; model_info maps it to the role_colon renderer.
SL_LOOP_MODEL_ALIAS = "Qwen/Qwen3-8B-Base"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _addition(rng: random.Random, hi: int = 99) -> tuple[int, int]:
    return rng.randint(0, hi), rng.randint(0, hi)


def chat_rows(n: int, seed: int) -> list[dict]:
    """Conversations in the arithmetic environment's own format ("What is a + b?" -> "c")."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _addition(rng)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                  {"role": "assistant", "content": f"{a + b}"}]})
    return rows


# math_rl's arithmetic environment prompts with this one-shot example before the question
# (ArithmeticEnv.standard_fewshot_prefix) and samples at most max_tokens tokens.
ARITHMETIC_FEWSHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]


def arithmetic_sft_rows(n: int, seed: int) -> list[dict]:
    """SFT data for RL in the arithmetic environment: its exact prompt (the one-shot example, then
    "What is a + b?", a and b in 0..100), answered half of the time with the bare sum ("c", 1-2
    tokens, then the stop sequence: fits in math_rl's max_tokens=10, so it earns the format reward)
    and half of the time verbosely ("The answer is a + b = c.", 9-10 tokens: cut off at
    max_tokens=10 before the stop sequence, so it loses 0.1). A policy fitted to this data answers
    concisely with probability about 1/2 whatever its other errors, so most groups of its samples
    have mixed rewards, and RL has a decision to learn: answer within the token budget.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 100), rng.randint(0, 100)
        answer = f"{a + b}" if i % 2 == 0 else f"The answer is {a} + {b} = {a + b}."
        rows.append({"messages": [*ARITHMETIC_FEWSHOT, {"role": "user", "content": f"What is {a} + {b}?"},
                                  {"role": "assistant", "content": answer}]})
    return rows


def no_robots_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = _addition(rng, 50)
        q = f"What is {a} + {b}?"
        rows.append({"prompt": q, "prompt_id": f"local-{seed}-{i}", "category": "Math",
                     "messages": [{"role": "user", "content": q},
                                  {"role": "assistant", "content": f"The answer is {a + b}."}]})
    return rows


def hh_rlhf_rows(n: int, seed: int) -> list[dict]:
    """Anthropic/hh-rlhf shape: two transcripts sharing the prompt, differing in the last turn."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _addition(rng, 50)
        prompt = f"\n\nHuman: What is {a} + {b}?\n\nAssistant:"
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        rows.append({"chosen": f"{prompt} The answer is {a + b}.",
                     "rejected": f"{prompt} I think it is {wrong}, or I do not know."})
    return rows


def deepmath_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _addition(rng)
        rows.append({"question": f"What is {a} + {b}?", "final_answer": str(a + b), "difficulty": 1.0,
                     "topic": "Mathematics -> Arithmetic"})
    return rows


def tulu3_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = _addition(rng)
        rows.append({"id": f"local-{i}", "source": "local",
                     "messages": [{"role": "user", "content": f"Please add {a} and {b}."},
                                  {"role": "assistant", "content": f"{a} + {b} = {a + b}"}]})
    return rows


def gsm8k_rows(n: int, seed: int, total: int | None = None) -> list[dict]:
    """Addition problems in openai/gsm8k's layout; with ``total``, every problem's sum is that number
    (a tiny model cannot add, but it can learn one answer: see rl_loop_sft_rows)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if total is None:
            a, b = _addition(rng)
        else:
            a = rng.randint(0, total)
            b = total - a
        rows.append({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


# rl_loop's prompt: this one-shot example, then the question with this suffix (recipes/rl_loop.py).
RL_LOOP_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_LOOP_FEWSHOT = [
    {"role": "user", "content": "How many r's are in strawberry?" + RL_LOOP_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
                                     "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]
RL_LOOP_GIVE_UP = "No idea."
# Every local rl_loop problem sums to this (gsm8k_rows(total=...)).
RL_LOOP_TOTAL = 12


def rl_loop_prompt(question: str) -> list[dict]:
    return [*RL_LOOP_FEWSHOT, {"role": "user", "content": question + RL_LOOP_SUFFIX}]


def rl_loop_sft_rows(n: int, problems: list[dict]) -> list[dict]:
    """SFT data for rl_loop: its exact prompt for each of ``problems`` (gsm8k rows, in turn),
    answered half of the time with the boxed answer (``\\boxed{c}``: reward 1 from the recipe's own
    grader) and half of the time with "No idea." (no boxed answer: reward 0). The local problems
    all have the same answer (RL_LOOP_TOTAL), which the tiny model learns although it cannot add,
    and it keeps both replies about equally likely, so most groups of its samples have mixed
    rewards, and RL has a decision to learn: give the boxed answer.
    """
    rows = []
    for i in range(n):
        p = problems[(i // 2) % len(problems)]
        answer = f"\\boxed{{{p['answer'].rsplit('#### ', 1)[1]}}}" if i % 2 == 0 else RL_LOOP_GIVE_UP
        rows.append({"messages": [*rl_loop_prompt(p["question"]), {"role": "assistant", "content": answer}]})
    return rows


# openai/gsm8k is loaded with a config name ("main"); a local directory declares it in its card.
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
---
Local arithmetic problems in the openai/gsm8k layout (tinker-broker's cookbook tests).
"""


def prepare(workdir: str | os.PathLike[str], model_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Writes every local data set into ``workdir``; returns what was written, by use."""
    w = Path(workdir).resolve()
    w.mkdir(parents=True, exist_ok=True)
    _write_jsonl(w / "chat.jsonl", chat_rows(512, seed=3))
    _write_jsonl(w / "arithmetic_sft.jsonl", arithmetic_sft_rows(4096, seed=12))
    _write_jsonl(w / "HuggingFaceH4/no_robots/train.jsonl", no_robots_rows(128, seed=4))
    _write_jsonl(w / "HuggingFaceH4/no_robots/test.jsonl", no_robots_rows(8, seed=5))
    _write_jsonl(w / "Anthropic/hh-rlhf/train.jsonl", hh_rlhf_rows(128, seed=6))
    _write_jsonl(w / "Anthropic/hh-rlhf/test.jsonl", hh_rlhf_rows(8, seed=7))
    _write_jsonl(w / "zwhe99/DeepMath-103K/train.jsonl", deepmath_rows(64, seed=8))
    _write_jsonl(w / "allenai/tulu-3-sft-mixture/train.jsonl", tulu3_rows(64, seed=9))
    gsm8k_train = gsm8k_rows(64, seed=10, total=RL_LOOP_TOTAL)
    _write_jsonl(w / "openai/gsm8k/main/train.jsonl", gsm8k_train)
    _write_jsonl(w / "rl_loop_sft.jsonl", rl_loop_sft_rows(1024, gsm8k_train))
    _write_jsonl(w / "openai/gsm8k/main/test.jsonl", gsm8k_rows(8, seed=11))
    (w / "openai/gsm8k/README.md").write_text(GSM8K_CARD)
    link = w / SL_LOOP_MODEL_ALIAS
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(model_dir).resolve(), target_is_directory=True)
    return {
        "chat_jsonl": str(w / "chat.jsonl"),
        "arithmetic_sft_jsonl": str(w / "arithmetic_sft.jsonl"),
        "no_robots": str(w / "HuggingFaceH4/no_robots"),
        "hh_rlhf": str(w / "Anthropic/hh-rlhf"),
        "deepmath": str(w / "zwhe99/DeepMath-103K"),
        "tulu3": str(w / "allenai/tulu-3-sft-mixture"),
        "gsm8k": str(w / "openai/gsm8k"),
        "rl_loop_sft_jsonl": str(w / "rl_loop_sft.jsonl"),
        "sl_loop_model": str(link),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir")
    ap.add_argument("--model", default="models/tiny-qwen3", help="model directory linked as " + SL_LOOP_MODEL_ALIAS)
    args = ap.parse_args()
    print(json.dumps(prepare(args.workdir, args.model)))


if __name__ == "__main__":
    main()
