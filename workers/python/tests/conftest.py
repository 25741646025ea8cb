"""Shared fixtures: the tiny model (generated once per session) and fresh engines over it."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

PY_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT = PY_ROOT.parents[1]
# Every op's result is checked against its schema in protocol.json (the protocol both sides follow).
os.environ["TB_ENGINE_CHECK_RESULTS"] = "1"
if str(PY_ROOT) not in sys.path:
    sys.path.insert(0, str(PY_ROOT))

from tinker_engine.device import Placement  # noqa: E402
from tinker_engine.engine import Engine  # noqa: E402

from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()


def pytest_configure(config: pytest.Config) -> None:
    # transformers/PEFT deprecation notices from their own internals.
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning")

BASE = "tiny"


def load_make_tiny_model() -> ModuleType:
    path = REPO_ROOT / "scripts" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_tiny_model"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def make_tiny() -> ModuleType:
    return load_make_tiny_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, make_tiny: ModuleType) -> Path:
    return make_tiny.make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    torch.manual_seed(0)
    eng = Engine(Placement(device=torch.device("cpu"), dtype=torch.float32), sampler_cache_size=4)
    eng.call("load_base", {"name": BASE, "path": str(tiny_model_dir)})
    yield eng
