"""Off-policy top-K distillation with the cookbook's own training loop.

tinker-cookbook 0.6.1 ships the loop (``tinker_cookbook.distillation.train_off_policy.main``:
teacher-forces each example through the teacher with ``topk_prompt_logprobs=K`` and trains the
student with 2-D ``cross_entropy`` on the renormalised top-K) but no command-line recipe for it
(``recipes/distillation/off_policy_reasoning.py`` is plain SFT on OpenThoughts3). This is that
missing command line: a local conversations JSONL, one teacher per ``teacher_model`` (served by
name), everything else the cookbook's.

    python test/e2e/cookbook/off_policy_topk.py model_name=<student> teacher_model=<name> \
        data=<file>.jsonl renderer_name=role_colon log_path=<dir> [batch_size=8 max_steps=4 ...]

Metrics go to ``<log_path>/metrics.jsonl`` (``train/loss:sum`` is the summed soft cross-entropy
against the teacher's top-K distribution).
"""

from __future__ import annotations

import asyncio

import chz

from tinker_cookbook.distillation import train_off_policy
from tinker_cookbook.distillation.datasets import TeacherConfig
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


@chz.chz
class CLIConfig:
    model_name: str
    teacher_model: str
    data: str
    log_path: str
    renderer_name: str = "role_colon"
    teacher_checkpoint: str | None = None
    load_checkpoint_path: str | None = None
    n_teacher_targets: int = 20
    batch_size: int = 8
    max_length: int = 256
    learning_rate: float = 1e-3
    lora_rank: int = 8
    max_steps: int | None = 4
    save_every: int = 0
    base_url: str | None = None


def build_config(cli: CLIConfig) -> train_off_policy.Config:
    dataset_builder = FromConversationFileBuilder(
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=cli.model_name,
            renderer_name=cli.renderer_name,
            max_length=cli.max_length,
            batch_size=cli.batch_size,
        ),
        file_path=cli.data,
    )
    return train_off_policy.Config(
        learning_rate=cli.learning_rate,
        dataset_configs=[
            train_off_policy.DatasetWithTeacher(
                dataset_builder=dataset_builder,
                teacher_config=TeacherConfig(base_model=cli.teacher_model, load_checkpoint_path=cli.teacher_checkpoint),
            )
        ],
        model_name=cli.model_name,
        recipe_name="recipe_distillation_off_policy_topk",
        renderer_name=cli.renderer_name,
        lora_rank=cli.lora_rank,
        n_teacher_targets=cli.n_teacher_targets,
        batch_size=cli.batch_size,
        save_every=cli.save_every,
        max_steps=cli.max_steps,
        load_checkpoint_path=cli.load_checkpoint_path,
        log_path=cli.log_path,
        base_url=cli.base_url,
    )


if __name__ == "__main__":
    asyncio.run(train_off_policy.main(build_config(chz.entrypoint(CLIConfig))))
