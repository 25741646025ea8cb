"""RL with a KL penalty against a reference model: the cookbook's math_rl recipe, unchanged, run
through its own entry (``cli_main``) with its own arguments, plus the one setting its command line
does not expose: ``kl_reference_config`` of the cookbook's RL trainer (``tinker_cookbook.rl.train.
Config``), which ``kl_penalty_coef > 0`` requires (without it the trainer stops with
"kl_reference_config must be specified when kl_penalty_coef > 0"). The trainer then asks the
reference, by name, for the logprobs of every sampled sequence each step (``incorporate_kl_penalty``).

    python test/e2e/standin/rl_kl.py REFERENCE_MODEL --workdir DIR [key=value ...]

``key=value`` are math_rl's own arguments (over run.py's math_rl defaults; ``kl_penalty_coef``
defaults to 0.1 here). The recipe runs in DIR (model names that are local directories there resolve
as the tokenizer). The last line printed is one JSON object: the command, the log path and every
metrics row, as test/e2e/cookbook/run.py prints them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cookbook"))

import run as cookbook_run  # noqa: E402  (test/e2e/cookbook/run.py: defaults, data, metrics reader)


def main(argv: list[str]) -> int:
    reference, rest = argv[0], argv[1:]
    workdir = Path("var/standin-rl-kl")
    overrides: dict[str, str] = {"kl_penalty_coef": "0.1"}
    i = 0
    while i < len(rest):
        if rest[i] == "--workdir":
            workdir = Path(rest[i + 1])
            i += 2
            continue
        k, v = rest[i].split("=", 1)
        overrides[k] = v
        i += 1
    workdir = workdir.resolve()
    models = cookbook_run._models()
    cookbook_run.data.prepare(workdir, cookbook_run.ROOT / "models/tiny-qwen3")
    log_path = workdir / "runs" / "rl_kl"
    fill = {**models, "workdir": str(workdir), "log_path": str(log_path)}
    args = {k: v.format(**fill) for k, v in cookbook_run.RECIPES["math_rl"][1].items()}
    args.update(overrides)
    argv_recipe = [f"{k}={v}" for k, v in args.items() if v != ""]

    os.chdir(workdir)
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[k] = "1"
    import chz
    from tinker_cookbook.recipes.math_rl import train as recipe
    from tinker_cookbook.rl.train import KLReferenceConfig

    trainer_main = recipe.main

    async def with_reference(config):
        return await trainer_main(chz.replace(config, kl_reference_config=KLReferenceConfig(base_model=reference)))

    recipe.main = with_reference  # the recipe's cli_main builds its Config, then calls main(config)
    t0 = time.time()
    asyncio.run(recipe.cli_main(chz.entrypoint(recipe.CLIConfig, argv=argv_recipe)))
    print(json.dumps({"recipe": "math_rl+kl_reference", "reference": reference, "cmd": argv_recipe,
                      "log_path": str(log_path), "seconds": round(time.time() - t0, 1),
                      "metrics": cookbook_run.read_metrics(log_path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
