"""The engines' settings: read from the environment in one place each, checked, a bad value named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinker_engine import settings
from tinker_engine.settings import EngineSettings, SettingsError, load
from tinker_engine_verl.settings import VerlSettings

PY_ROOT = Path(__file__).resolve().parents[1]


def test_defaults_when_unset_or_empty() -> None:
    assert load(EngineSettings, {}) == EngineSettings()
    assert load(EngineSettings, {"TB_ENGINE_SAMPLE_TOKENS": "", "TB_ENGINE_DEVICE": ""}) == EngineSettings()
    assert load(VerlSettings, {}) == VerlSettings()
    assert (EngineSettings().max_batch_tokens, EngineSettings().sampler_cache, EngineSettings().log_level) == (16384, 4, "INFO")
    v = VerlSettings()
    assert (v.strategy, v.offload, v.grad_ckpt, v.remove_padding, v.attn) == ("fsdp2", False, None, None, "sdpa")


def test_values_are_parsed() -> None:
    s = load(EngineSettings, {"TB_ENGINE_DEVICE": "cuda:1", "TB_ENGINE_DTYPE": "bfloat16", "TB_ENGINE_LOG_LEVEL": "warning",
                              "TB_ENGINE_SAMPLE_TOKENS": "1000", "TB_ENGINE_SAMPLER_CACHE": "2",
                              "TB_ENGINE_MAX_BATCH_TOKENS": "12", "TB_ENGINE_CHECK_RESULTS": "1", "TB_GPU_MEMORY": "0.35"})
    assert s == EngineSettings(device="cuda:1", dtype="bfloat16", log_level="WARNING", sample_tokens=1000,
                               sampler_cache=2, max_batch_tokens=12, check_results=True, memory_fraction=0.35)
    assert load(EngineSettings, {"TB_GPU_MEMORY": "1"}).memory_fraction == 1.0
    v = load(VerlSettings, {"TB_VERL_STRATEGY": "veomni", "TB_VERL_OFFLOAD": "1", "TB_VERL_GRAD_CKPT": "false",
                            "TB_VERL_REMOVE_PADDING": "1", "TB_VERL_ATTN": "eager", "TB_VERL_RECORD": "/tmp/x",
                            "TB_VERL_RECORD_MAX_TOKENS": "64"})
    assert v == VerlSettings(strategy="veomni", offload=True, grad_ckpt=False, remove_padding=True, attn="eager",
                             record="/tmp/x", record_max_tokens=64)
    assert (load(VerlSettings, {"TB_VERL_GRAD_CKPT": "auto", "TB_VERL_REMOVE_PADDING": "auto"}).grad_ckpt, load(VerlSettings, {"TB_VERL_GRAD_CKPT": "true"}).grad_ckpt) == (None, True)


@pytest.mark.parametrize("cls, name, value, why", [
    (EngineSettings, "TB_ENGINE_SAMPLE_TOKENS", "abc", "a positive integer"),
    (EngineSettings, "TB_ENGINE_SAMPLER_CACHE", "0", "a positive integer"),
    (EngineSettings, "TB_ENGINE_MAX_BATCH_TOKENS", "1.5", "a positive integer"),
    (EngineSettings, "TB_ENGINE_MAX_BATCH_TOKENS", " 12", "a positive integer"),
    (EngineSettings, "TB_ENGINE_DEVICE", "cuda:0,1", "cpu, cuda or cuda:N"),
    (EngineSettings, "TB_ENGINE_DTYPE", "fp8", "one of float32, bfloat16, float16"),
    (EngineSettings, "TB_ENGINE_LOG_LEVEL", "loud", "one of DEBUG, INFO, WARNING, ERROR"),
    (EngineSettings, "TB_ENGINE_CHECK_RESULTS", "yes", "1, 0, true or false"),
    (EngineSettings, "TB_GPU_MEMORY", "0", "a number above 0 and at most 1"),
    (EngineSettings, "TB_GPU_MEMORY", "1.5", "a number above 0 and at most 1"),
    (EngineSettings, "TB_GPU_MEMORY", "nan", "a number above 0 and at most 1"),
    (EngineSettings, "TB_GPU_MEMORY", "-0.5", "a number above 0 and at most 1"),
    (EngineSettings, "TB_LOSS_CATALOGUE", "/nonexistent/losses.json", "a file that exists"),
    (EngineSettings, "TB_ENGINE_KERNELS", "triton", "one of none, liger"),
    (EngineSettings, "TB_ENGINE_CUDNN_ATTENTION", "on", "1, 0, true or false"),
    (VerlSettings, "TB_VERL_STRATEGY", "megatron", "one of fsdp2, fsdp, veomni"),
    (VerlSettings, "TB_VERL_OFFLOAD", "on", "1, 0, true or false"),
    (VerlSettings, "TB_VERL_REMOVE_PADDING", "yes", "auto, 1, 0, true or false"),
    (VerlSettings, "TB_VERL_GRAD_CKPT", "AUTO", "auto, 1, 0, true or false"),
    (VerlSettings, "TB_VERL_ATTN", "flash", "one of sdpa, eager"),
    (VerlSettings, "TB_VERL_RECORD_MAX_TOKENS", "-1", "a positive integer"),
])
def test_a_bad_value_is_refused_naming_its_variable(cls: type, name: str, value: str, why: str) -> None:
    with pytest.raises(SettingsError, match=rf"^{name}='{value}': must be {why}"):
        load(cls, {name: value})


def test_overridden_holds_inside_its_block_only() -> None:
    before = settings.current()
    assert before.check_results  # conftest: the tests check every result against its schema
    with settings.overridden(max_batch_tokens=3) as s:
        assert settings.current() is s and s.max_batch_tokens == 3
    assert settings.current() is before


def test_the_engine_refuses_to_start_on_a_bad_setting() -> None:
    path = os.pathsep.join(p for p in (str(PY_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TB_ENGINE_DEVICE": "cpu", "TB_ENGINE_SAMPLER_CACHE": "many"}
    run = subprocess.run([sys.executable, "-m", "tinker_engine"], input=b"", capture_output=True, env=env, timeout=120)
    assert run.returncode != 0
    assert "TB_ENGINE_SAMPLER_CACHE='many': must be a positive integer" in run.stderr.decode()


def test_fused_kernels_on_the_cpu_stop_the_engine_at_its_start_saying_why() -> None:
    """TB_ENGINE_KERNELS=liger: Liger's kernels are Triton kernels (CUDA only); a CPU engine refuses to
    start rather than train unfused while its operator believes otherwise (kernels.py)."""
    assert load(EngineSettings, {"TB_ENGINE_KERNELS": "liger"}).kernels == "liger"
    path = os.pathsep.join(p for p in (str(PY_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TB_ENGINE_DEVICE": "cpu", "TB_ENGINE_KERNELS": "liger"}
    run = subprocess.run([sys.executable, "-m", "tinker_engine"], input=b"", capture_output=True, env=env, timeout=120)
    assert run.returncode != 0
    assert "TB_ENGINE_KERNELS=liger needs a CUDA device" in run.stderr.decode()


@pytest.mark.parametrize("env, device, calls", [
    ({"TB_ENGINE_DEVICE": "cuda:0"}, "cuda:0", [False]),
    ({"TB_ENGINE_DEVICE": "cuda", "TB_ENGINE_CUDNN_ATTENTION": "0"}, "cuda:0", [False]),
    ({"TB_ENGINE_DEVICE": "cuda:0", "TB_ENGINE_CUDNN_ATTENTION": "1"}, "cuda:0", []),
    ({"TB_ENGINE_DEVICE": "cpu"}, "cpu", []),
])
def test_cudnn_attention_is_left_out_on_cuda_unless_asked_for(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                            device: str, calls: list[bool]) -> None:
    """cuDNN's attention builds an execution plan per new (batch, length) shape; concurrent sample requests
    joining a running batch make every decode step a new shape (measured 2.3 s per joining call on an H100,
    docs/benchmarks.md). The engine leaves it out of SDPA on CUDA (device.py) unless
    TB_ENGINE_CUDNN_ATTENTION=1; on the CPU there is nothing to change. CUDA is stood in for here: the
    placement only names the device, and the backend switch is recorded instead of made."""
    import torch

    from tinker_engine import device as device_mod

    made: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", made.append)
    placement = device_mod.placement_from_env(load(EngineSettings, env))
    assert str(placement.device) == device
    assert made == calls
