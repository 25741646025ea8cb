"""How likely a policy is to give the rewarded answer, read exactly from its weights.

    python test/e2e/cookbook/policy_probe.py math_rl <model> <renderer> <sampler_path> [...]
    python test/e2e/cookbook/policy_probe.py rl_loop <model> <renderer> <workdir> <sampler_path> [...]

For each sampler path (tinker://…/sampler_weights/…, served by the server at TINKER_BASE_URL), the
probabilities are exact prompt logprobs of the weights (compute_logprobs), not samples: the only
randomness in a before / after comparison is in the training run between the two weights.

``math_rl``: the probability of the first token of the verbose answer that
data.arithmetic_sft_rows teaches ("The answer is a + b = c.", which never fits in math_rl's
max_tokens=10 and so always loses the format reward) right after the arithmetic environment's own
prompt (its one-shot example, then "What is a + b?", rendered as ArithmeticEnv renders it), for 64
fixed problems. Prints ``{"verbose_token": str, "problems": n, "paths": {path: [p, ...]}}``.

``rl_loop``: for each problem of the local openai/gsm8k train split in <workdir> (those rl_loop
samples and data.rl_loop_sft_rows trains on), after rl_loop's own prompt, the probability of the whole rewarded answer ``\\boxed{c}`` (c the problem's answer: reward
1 from the recipe's grader) and of the whole unrewarded "No idea." (no boxed answer: 0). Prints
``{"problems": n, "correct": {path: [p, ...]}, "give_up": {path: [p, ...]}}``.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import tinker
from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import get_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402


def _answer_tokens(renderer, convo: list[dict], answer: str) -> tuple[list[int], list[int]]:
    """The generation prompt of ``convo`` and the tokens of ``answer`` as the assistant's reply (up
    to the answer's last character: the end-of-turn tokens after it are not part of the answer)."""
    prompt = renderer.build_generation_prompt(convo).to_ints()
    full = renderer.build_supervised_example([*convo, {"role": "assistant", "content": answer}])[0].to_ints()
    assert full[: len(prompt)] == prompt, "the rendered answer does not extend the generation prompt"
    reply = full[len(prompt):]
    for k in range(1, len(reply) + 1):
        if renderer.tokenizer.decode(reply[:k]).strip() == answer:
            return prompt, reply[:k]
    raise AssertionError(f"the rendered reply {renderer.tokenizer.decode(reply)!r} does not hold {answer!r}")


def _logprobs(paths: list[str], sequences: list[list[int]]) -> dict[str, list[list[float]]]:
    """Per path, the prompt logprobs of every sequence (position 0 has none: None)."""
    service = tinker.ServiceClient()
    out: dict[str, list[list[float]]] = {}
    for path in paths:
        client = service.create_sampling_client(model_path=path).result()
        futures = [client.compute_logprobs(tinker.ModelInput.from_ints(s)) for s in sequences]
        out[path] = [f.result() for f in futures]
    return out


def math_rl(model: str, renderer_name: str, paths: list[str]) -> dict:
    renderer = renderers.get_renderer(renderer_name, tokenizer=get_tokenizer(model))
    rng = random.Random(2026)
    problems = [(rng.randint(0, 100), rng.randint(0, 100)) for _ in range(64)]
    sequences: list[list[int]] = []
    verbose_first: int | None = None
    for a, b in problems:
        convo = [*data.ARITHMETIC_FEWSHOT, {"role": "user", "content": f"What is {a} + {b}?"}]
        prompt, answer = _answer_tokens(renderer, convo, f"The answer is {a} + {b} = {a + b}.")
        assert verbose_first in (None, answer[0]), "the verbose answer starts with different tokens"
        verbose_first = answer[0]
        sequences.append([*prompt, verbose_first])
    assert verbose_first is not None
    lps = _logprobs(paths, sequences)
    return {"verbose_token": renderer.tokenizer.decode([verbose_first]), "problems": len(problems),
            "paths": {p: [math.exp(lp[-1]) for lp in rows] for p, rows in lps.items()}}


def rl_loop(model: str, renderer_name: str, workdir: str, paths: list[str]) -> dict:
    renderer = renderers.get_renderer(renderer_name, tokenizer=get_tokenizer(model))
    rows = [json.loads(line) for line in (Path(workdir) / "openai/gsm8k/main/train.jsonl").read_text().splitlines()]
    problems = list({r["question"]: r for r in rows}.values())
    sequences: list[list[int]] = []
    spans: list[tuple[int, int]] = []  # where the answer lies in each sequence
    for p in problems:
        convo = data.rl_loop_prompt(p["question"])
        for answer in (f"\\boxed{{{p['answer'].rsplit('#### ', 1)[1]}}}", data.RL_LOOP_GIVE_UP):
            prompt, tokens = _answer_tokens(renderer, convo, answer)
            sequences.append([*prompt, *tokens])
            spans.append((len(prompt), len(prompt) + len(tokens)))
    lps = _logprobs(paths, sequences)
    correct_p: dict[str, list[float]] = {}
    give_up_p: dict[str, list[float]] = {}
    for path, rows_lp in lps.items():
        p_answer = [math.exp(sum(lp[a:b])) for lp, (a, b) in zip(rows_lp, spans)]
        correct_p[path], give_up_p[path] = p_answer[0::2], p_answer[1::2]
    return {"problems": len(problems), "correct": correct_p, "give_up": give_up_p}


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "math_rl":
        out = math_rl(rest[0], rest[1], rest[2:])
    elif mode == "rl_loop":
        out = rl_loop(rest[0], rest[1], rest[2], rest[3:])
    else:
        sys.stderr.write(f"unknown probe {mode!r}: math_rl or rl_loop\n")
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
