"""The engine's settings: every variable of its environment the torch engine reads, parsed and checked once.

An agent decides the settings a user may change (queues/infra/config.ts: each declared there once, with
its bound and default) and passes every one to the engine explicitly. The defaults below are the same
(test/one-source-engine-settings.test.ts compares them), so an engine started by hand, by a test or by a
bench behaves like one an agent starts. The internal knobs of tests and benches (config.ts
``ENGINE_INTERNAL_ENV``) are read here too. No other module of the engines reads its environment for a
``TB_`` variable; the verl engine declares its own in ``tinker_engine_verl/settings.py`` with the
helpers below.

The environment is read at the first ``current()`` (the entry points call it as they start, in
``channel.claim_stdio``); a bad value stops the engine with a ``SettingsError`` naming the variable.
Standard library only: anything may import it, and the agent's test reads it without torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")


class SettingsError(ValueError):
    """A variable of the engine's environment holds a value the engine does not accept."""


@dataclass(frozen=True)
class Variable:
    """How one setting comes from the environment: its variable, its parser, the values it accepts."""

    name: str
    parse: Callable[[str], Any]
    #: The accepted values, when the setting is one of a few (for the comparison with config.ts).
    choices: tuple[str, ...] | None = None


def variable(name: str, parse: Callable[[str], T], default: T, choices: tuple[str, ...] | None = None) -> Any:
    """A settings dataclass field read from ``name`` (unset or empty: ``default``)."""
    return field(default=default, metadata={"variable": Variable(name, parse, choices)})


# --- parsers: each raises ValueError saying what is accepted -----------------------------------------

def positive_int(raw: str) -> int:
    """Decimal digits only (no sign, space or exponent), at least 1."""
    if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:
        raise ValueError("a positive integer")
    return int(raw)


def fraction(raw: str) -> float:
    """A decimal number in (0, 1] (the agent writes it as JavaScript prints a number)."""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not re.fullmatch(r"[0-9]*\.?[0-9]+(e-?[0-9]+)?", raw) or not 0 < value <= 1:
        raise ValueError("a number above 0 and at most 1")
    return value


def flag(raw: str) -> bool:
    """``1``/``true`` or ``0``/``false`` (the agent writes ``1``/``0``)."""
    if raw not in ("1", "true", "0", "false"):
        raise ValueError("1, 0, true or false")
    return raw in ("1", "true")


def auto_flag(raw: str) -> bool | None:
    """``auto`` (None: the engine chooses), or a ``flag``."""
    if raw == "auto":
        return None
    try:
        return flag(raw)
    except ValueError:
        raise ValueError("auto, 1, 0, true or false") from None


def choice(*choices: str, upper: bool = False) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.upper() if upper else raw
        if value not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return value

    return parse


def device_name(raw: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", raw):
        raise ValueError("cpu, cuda or cuda:N")
    return raw


def existing_file(raw: str) -> str:
    if not Path(raw).is_file():
        raise ValueError("a file that exists")
    return raw


def load(cls: type[S], environ: Mapping[str, str] | None = None) -> S:
    """``cls`` (a dataclass of ``variable`` fields) from ``environ`` (default: the process's environment).
    Values are taken as written (no spaces trimmed), as the agent's configuration takes them."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        var: Variable = f.metadata["variable"]
        raw = env.get(var.name, "")
        if not raw:
            continue
        try:
            values[f.name] = var.parse(raw)
        except ValueError as exc:
            raise SettingsError(f"{var.name}={raw!r}: must be {exc}") from None
    return cls(**values)


def describe(cls: type) -> dict[str, dict[str, Any]]:
    """Each variable of ``cls``: its default and accepted values (what the agent's configuration is compared with)."""
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(cls):
        var: Variable = f.metadata["variable"]
        out[var.name] = {"default": f.default, "choices": list(var.choices) if var.choices else None}
    return out


DTYPES = ("float32", "bfloat16", "float16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LAYOUTS = ("auto", "packed", "padded")
KERNELS = ("none", "liger")


@dataclass(frozen=True)
class EngineSettings:
    """The torch engine's settings (the verl engine uses those it shares: ``max_batch_tokens``, the log level)."""

    #: ``TB_ENGINE_DEVICE``: ``cpu``, ``cuda`` or ``cuda:N``; unset: cuda:0 when available, else cpu (device.py).
    device: str | None = variable("TB_ENGINE_DEVICE", device_name, None)
    #: ``TB_ENGINE_DTYPE``: the base weights' dtype when the model names none; unset: bfloat16 on CUDA, float32 on the CPU.
    dtype: str | None = variable("TB_ENGINE_DTYPE", choice(*DTYPES), None, DTYPES)
    #: ``TB_ENGINE_LOG_LEVEL``: the level of the engine's log on stderr (the agent passes its own).
    log_level: str = variable("TB_ENGINE_LOG_LEVEL", choice(*LOG_LEVELS, upper=True), "INFO", LOG_LEVELS)
    #: ``TB_ENGINE_SAMPLE_TOKENS``: most cache slots (rows x padded length at its longest) one generating
    #: sample batch holds; requests beyond it wait for rows to finish (sample.py).
    sample_tokens: int = variable("TB_ENGINE_SAMPLE_TOKENS", positive_int, 262144)
    #: ``TB_ENGINE_SAMPLER_CACHE``: sampler versions (LoRA adapters) kept loaded per base model.
    sampler_cache: int = variable("TB_ENGINE_SAMPLER_CACHE", positive_int, 4)
    #: ``TB_ENGINE_MAX_BATCH_TOKENS``: most tokens of one training micro-batch (train.py: real tokens when
    #: packed, padded ones when padded; verl's ``max_token_len_per_gpu``).
    max_batch_tokens: int = variable("TB_ENGINE_MAX_BATCH_TOKENS", positive_int, 16384)
    #: ``TB_ENGINE_LAYOUT``: how a training micro-batch is laid out (packing.py): ``packed`` (its datums
    #: concatenated into one row, attention kept within each datum, no padding computed), ``padded``, or
    #: ``auto``: packed where the attention kernel is variable-length (flash-attn on CUDA), else padded.
    layout: str = variable("TB_ENGINE_LAYOUT", choice(*LAYOUTS), "auto", LAYOUTS)
    #: ``TB_ENGINE_HEAD_CHUNK_TOKENS``: tokens per chunk of the output layer (chunked_logprobs.py): a
    #: micro-batch's logits exist one chunk at a time, each chunk recomputed in the backward (one more
    #: output-layer matmul per token); at or above TB_ENGINE_MAX_BATCH_TOKENS the logits are kept whole
    #: and nothing is recomputed. The default keeps them whole, the path measured on the GPU, until
    #: bench/gpu/packing.sh shows what chunks cost there (docs/benchmarks.md).
    head_chunk_tokens: int = variable("TB_ENGINE_HEAD_CHUNK_TOKENS", positive_int, 16384)
    #: ``TB_ENGINE_KERNELS``: fused kernels in the base model's layers (kernels.py): ``none``, or ``liger``
    #: (Liger's Triton RMSNorm, SwiGLU and rotary embedding; CUDA only, the liger-kernel package installed).
    kernels: str = variable("TB_ENGINE_KERNELS", choice(*KERNELS), "none", KERNELS)
    #: ``TB_ENGINE_CUDNN_ATTENTION``: on CUDA, let ``scaled_dot_product_attention`` use cuDNN's attention.
    #: Off by default (device.py): cuDNN builds an execution plan for every new (batch, length) shape,
    #: tens of milliseconds each, and a decode step's cache length is new at every step once rows joined
    #: a running batch at another step; off, torch picks flash, memory-efficient or math attention.
    cudnn_attention: bool = variable("TB_ENGINE_CUDNN_ATTENTION", flag, False)
    #: ``TB_GPU_MEMORY`` (the agent's): the share of the GPU this engine may use, 0 < x <= 1 (a preset's
    #: ``gpu_memory``, when agents share a GPU): the CUDA allocator is capped there (device.py); unset: no cap.
    memory_fraction: float | None = variable("TB_GPU_MEMORY", fraction, None)
    #: ``TB_ENGINE_CHECK_RESULTS`` (internal; the tests set it): every result is checked against its op's schema.
    check_results: bool = variable("TB_ENGINE_CHECK_RESULTS", flag, False)
    #: ``TB_LOSS_CATALOGUE`` (internal): another copy of queues/contract/losses.json; unset: the project's.
    loss_catalogue: str | None = variable("TB_LOSS_CATALOGUE", existing_file, None)


class Loaded(Generic[S]):
    """The values of a settings dataclass, read from the environment at the first ``get()``."""

    def __init__(self, cls: type[S]) -> None:
        self.cls = cls
        self._value: S | None = None

    def get(self) -> S:
        if self._value is None:
            self._value = load(self.cls)
        return self._value

    @contextlib.contextmanager
    def overridden(self, **changes: Any) -> Iterator[S]:
        """The settings with ``changes`` inside the block (tests: one engine, other settings)."""
        before = self.get()
        self._value = dataclasses.replace(before, **changes)  # type: ignore[type-var]
        try:
            yield self._value
        finally:
            self._value = before


_ENGINE = Loaded(EngineSettings)
#: The torch engine's settings (read at the first call).
current = _ENGINE.get
overridden = _ENGINE.overridden
