"""How likely a policy is to start the verbose answer in math_rl's arithmetic environment.

    python test/e2e/cookbook/policy_probe.py <model> <renderer> <sampler_path> [<sampler_path> ...]

For each sampler path (tinker://…/sampler_weights/…, served by the server at TINKER_BASE_URL),
the probability of the first token of the verbose answer that data.arithmetic_sft_rows teaches
("The answer is a + b = c.", which never fits in math_rl's max_tokens=10 and so always loses the
format reward) right after the environment's own prompt (its one-shot example, then "What is
a + b?", rendered as ArithmeticEnv renders it), for 64 fixed problems. The probabilities are exact
prompt logprobs of the weights (compute_logprobs), not samples: the only randomness in a before /
after comparison is in the training run between the two weights.

Prints one JSON object: ``{"verbose_token": str, "problems": n, "paths": {path: [p, ...]}}``.
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


def main(argv: list[str]) -> int:
    model, renderer_name, paths = argv[0], argv[1], argv[2:]
    tokenizer = get_tokenizer(model)
    renderer = renderers.get_renderer(renderer_name, tokenizer=tokenizer)
    rng = random.Random(2026)
    problems = [(rng.randint(0, 100), rng.randint(0, 100)) for _ in range(64)]
    prompts: list[list[int]] = []
    verbose_first: int | None = None
    for a, b in problems:
        convo = [*data.ARITHMETIC_FEWSHOT, {"role": "user", "content": f"What is {a} + {b}?"}]
        prompt = renderer.build_generation_prompt(convo).to_ints()
        verbose = [*convo, {"role": "assistant", "content": f"The answer is {a} + {b} = {a + b}."}]
        full = renderer.build_supervised_example(verbose)[0].to_ints()
        assert full[: len(prompt)] == prompt, "the rendered answer does not extend the generation prompt"
        first = full[len(prompt)]
        assert verbose_first in (None, first), "the verbose answer starts with different tokens"
        verbose_first = first
        prompts.append(prompt)
    assert verbose_first is not None
    service = tinker.ServiceClient()
    out: dict[str, list[float]] = {}
    for path in paths:
        client = service.create_sampling_client(model_path=path).result()
        futures = [client.compute_logprobs(tinker.ModelInput.from_ints([*p, verbose_first])) for p in prompts]
        out[path] = [math.exp(f.result()[-1]) for f in futures]
    print(json.dumps({"verbose_token": tokenizer.decode([verbose_first]), "problems": len(problems), "paths": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
