"""The sampler's growing key/value cache (tinker_engine/kv_cache.py) against transformers' DynamicCache.

A ``GrowingLayer`` stores the same numbers ``DynamicLayer`` stores (a copy is a copy): its keys and
values are compared element for element, with ``torch.equal``, through prefill, decode steps, rows
selected away, caches merged and a crop. The sampler with it gives the same tokens and logprobs as
with plain ``DynamicLayer``s, bit for bit on the CPU (the same kernels read the same values; only the
strides of the key and value views differ, which the attention reads but does not sum in another
order here). Rows finishing at different lengths (max_tokens 40 to 120) exercise the selection.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from helpers import BASE, sampling
from tinker_engine import kv_cache, sample as sample_mod
from tinker_engine.engine import Engine
from tinker_engine.kv_cache import GrowingLayer


def kv(gen: torch.Generator, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 2, n, 4, generator=gen), torch.randn(rows, 2, n, 4, generator=gen)


def same(a: DynamicLayer, b: DynamicLayer) -> None:
    assert a.keys is not None and b.keys is not None and a.values is not None and b.values is not None
    assert a.keys.shape == b.keys.shape and torch.equal(a.keys, b.keys)
    assert a.values.shape == b.values.shape and torch.equal(a.values, b.values)
    assert a.get_seq_length() == b.get_seq_length()


def test_growing_layer_holds_what_dynamic_layer_holds_and_writes_in_place() -> None:
    gen = torch.Generator().manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()
    k, v = kv(gen, 3, 7)  # prefill of 7 positions
    ok, ov = grow.update(k, v)
    pk, pv = plain.update(k, v)
    assert torch.equal(ok, pk) and torch.equal(ov, pv)
    same(grow, plain)
    start = grow.keys.data_ptr()  # type: ignore[union-attr]
    for _ in range(kv_cache.MIN_ROOM):  # decode steps within the first buffer's room: no new buffer
        k, v = kv(gen, 3, 1)
        ok, ov = grow.update(k, v)
        pk, pv = plain.update(k, v)
        assert torch.equal(ok, pk) and torch.equal(ov, pv)
        assert grow.keys.data_ptr() == start  # type: ignore[union-attr]
    same(grow, plain)
    # Past the room: a new buffer, the same values.
    for _ in range(10):
        k, v = kv(gen, 3, 1)
        grow.update(k, v)
        plain.update(k, v)
    same(grow, plain)
    assert grow.keys.data_ptr() != start  # type: ignore[union-attr]
    # Rows finished: the buffers' rows are selected, room included, and the next steps still write in place.
    keep = torch.tensor([0, 2])
    grow.batch_select_indices(keep)
    plain.batch_select_indices(keep)
    same(grow, plain)
    selected = grow.keys.data_ptr()  # type: ignore[union-attr]
    for _ in range(3):
        k, v = kv(gen, 2, 1)
        grow.update(k, v)
        plain.update(k, v)
        same(grow, plain)
    assert grow.keys.data_ptr() == selected  # type: ignore[union-attr]
    # Keys replaced from outside (as a merge of a joining batch does): the next update moves them.
    extra_k, extra_v = kv(gen, 2, grow.get_seq_length())
    for layer in (grow, plain):
        layer.keys = torch.cat([layer.keys, extra_k])  # type: ignore[list-item]
        layer.values = torch.cat([layer.values, extra_v])  # type: ignore[list-item]
    for _ in range(3):
        k, v = kv(gen, 4, 1)
        grow.update(k, v)
        plain.update(k, v)
        same(grow, plain)
    # A crop, then more steps.
    grow.crop(-2)
    plain.crop(-2)
    k, v = kv(gen, 4, 1)
    grow.update(k, v)
    plain.update(k, v)
    same(grow, plain)
    # reset (transformers 5.24 empties the layer, 5.17 zeroes it in place): then as the plain layer.
    grow.reset()
    plain.reset()
    k, v = kv(gen, 4, 5)
    grow.update(k, v)
    plain.update(k, v)
    same(grow, plain)


def test_buffer_room_is_bounded() -> None:
    """The buffer holds at most 1 / GROWTH (or MIN_ROOM positions) more than the cache, and a 1000-step
    generation is moved only a few times: from 16 positions by MIN_ROOM up to 8 * 64 = 512, then by an
    eighth, 13 moves in all (against a copy of the whole cache at every step with torch.cat)."""
    gen = torch.Generator().manual_seed(1)
    layer = GrowingLayer()
    layer.update(*kv(gen, 1, 16))
    moves, last = 0, layer.keys.data_ptr()  # type: ignore[union-attr]
    for step in range(1000):
        layer.update(*kv(gen, 1, 1))
        length = 16 + step + 1
        assert layer._buffers is not None
        assert layer._buffers[0].shape[-2] <= length + max(kv_cache.MIN_ROOM, length // kv_cache.GROWTH)
        if layer.keys.data_ptr() != last:  # type: ignore[union-attr]
            moves, last = moves + 1, layer.keys.data_ptr()  # type: ignore[union-attr]
    assert moves <= 16, moves


def test_new_cache_keeps_sliding_layers_and_only_plain_layers_join() -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=100, use_sliding_window=True,
                         sliding_window=8, max_window_layers=2)
    cache = kv_cache.new_cache(config)
    kinds = [type(layer) for layer in cache.layers]
    assert GrowingLayer in kinds and DynamicSlidingWindowLayer in kinds, kinds
    assert not kv_cache.plain_layers(cache)  # a sliding window's rows are not merged by padding
    plain = kv_cache.new_cache(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100))
    assert all(type(layer) is GrowingLayer for layer in plain.layers) and kv_cache.plain_layers(plain)
    assert kv_cache.plain_layers(DynamicCache(config=Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                                 num_attention_heads=4, num_key_value_heads=2,
                                                                 head_dim=16, vocab_size=100)))


def _run(engine: Engine, staggered: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Requests added to one generation over several steps (later ones join the running batch), as the
    sampler does between decode steps; returns each request's sequences."""
    base = engine.registry.base(BASE)
    gen = sample_mod.Generation(base, max_tokens=100_000)
    reqs: list[sample_mod.SampleRequest] = []
    for group in staggered:
        _, parsed = sample_mod.parse_requests(engine.registry, {"base_model": BASE, "requests": group})
        assert all(isinstance(r, sample_mod.SampleRequest) for r in parsed)
        gen.add(parsed)  # type: ignore[arg-type]
        reqs += parsed  # type: ignore[arg-type]
        gen.step()
        gen.step()
    while gen.busy:
        gen.step()
    return [{"tokens": [s.tokens for s in r.sequences], "logprobs": [s.logprobs for s in r.sequences]} for r in reqs]


def request(prompt: list[int], max_tokens: int, seed: int, num_samples: int = 1) -> dict[str, Any]:
    return {"adapter_dir": None, "prompt": prompt, "num_samples": num_samples,
            "sampling_params": {**sampling(max_tokens=max_tokens, seed=seed), "stop_at_eos": False},
            "prompt_logprobs": False, "topk_prompt_logprobs": 0}


def test_sampler_with_growing_layers_equals_dynamic_layers(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    staggered = [
        [request([12, 400, 7, 88, 301], 90, seed=1, num_samples=3)],
        [request([3, 19], 40, seed=2), request([700, 701, 702, 703, 50, 9, 9, 9], 75, seed=3)],
        [request([9], 120, seed=4, num_samples=2)],
    ]
    growing = _run(engine, staggered)
    monkeypatch.setattr(sample_mod.kv_cache, "new_cache", lambda config: DynamicCache(config=config))
    plain = _run(engine, staggered)
    assert growing == plain
    assert [len(t) for r in growing for t in r["tokens"]] == [90, 90, 90, 40, 75, 120, 120]
