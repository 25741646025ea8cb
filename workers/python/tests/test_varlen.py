"""torch's variable-length attention as the packed row's kernel (varlen.py).

``torch.nn.attention.varlen.varlen_attn`` runs on CUDA only, so here it is replaced by a reference of
its contract: per sequence ``cu[i]:cu[i+1]`` of the packed (T, heads, head_dim) tensors, causal SDPA
over that sequence alone. What is tested on this CPU is everything around the kernel: both of its
signatures (grouped-query heads expanded for the first, ``enable_gqa`` for the later one), the
registration with transformers (no dense mask built, the staged cumulative lengths reaching the
kernel in every layer), the switch of the model's implementation and back, and a packed
forward_backward on it equal to the padded one up to float32 summation order. The real kernel's
agreement is measured on the device (bench/gpu/packing.sh prints the packed and padded losses).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_up_to_summation_order, create, datum, fb, grads, out_logprobs, perturb
from tinker_engine import packing, varlen
from tinker_engine.engine import Engine
from tinker_engine.settings import overridden

CALLS: list[dict[str, Any]] = []


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None,
                  gqa: bool) -> torch.Tensor:
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qq, kk, vv = (t[a:b].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1))
    return torch.cat(outs)


def later_api(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
              cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux: Any = None, scale: float | None = None,
              window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
    """The reference of torch's later varlen_attn signature."""
    assert window_size == (-1, 0), "causal attention is window (-1, 0)"
    assert cu_seq_q.dtype == torch.int32 and cu_seq_k is not None and torch.equal(cu_seq_q, cu_seq_k)
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    assert query.shape[1] == key.shape[1] or enable_gqa
    CALLS.append({"api": "later", "tokens": query.shape[0], "heads": (query.shape[1], key.shape[1])})
    return _per_sequence(query, key, value, cu_seq_q, scale, enable_gqa)


def first_api(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
              cu_seq_k: torch.Tensor, max_q: int, max_k: int, is_causal: bool = False,
              return_aux: Any = None) -> torch.Tensor:
    """The reference of torch's first varlen_attn signature: no scale, no grouped-query heads."""
    assert is_causal and query.shape[1] == key.shape[1], "the first signature needs as many key heads as query heads"
    CALLS.append({"api": "first", "tokens": query.shape[0], "heads": (query.shape[1], key.shape[1])})
    return _per_sequence(query, key, value, cu_seq_q, None, False)


@pytest.mark.parametrize("fn", [later_api, first_api], ids=["later", "first"])
def test_call_speaks_both_signatures(fn: varlen.Kernel) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5]
    t, hq, hk, d = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hk, hk))
    cu = torch.tensor([0, 3, 10, 11, 16], dtype=torch.int32)
    CALLS.clear()
    got = varlen.call(fn, q, k, v, cu, 7, d ** -0.5)
    assert got.shape == (t, hq, d) and CALLS[-1]["api"] == fn.__name__.split("_")[0]
    start = 0
    for n in lengths:  # each sequence alone, grouped-query heads repeated as the model's eager attention does
        qq = q[start:start + n].transpose(0, 1)
        kk, vv = (x[start:start + n].repeat_interleave(hq // hk, dim=1).transpose(0, 1) for x in (k, v))
        want = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(got[start:start + n], want)
        start += n
    if fn is first_api:
        with pytest.raises(ValueError, match="no scale argument"):
            varlen.call(fn, q, k, v, cu, 7, 0.5)


def test_attention_refuses_what_it_cannot_run() -> None:
    x = torch.zeros(2, 2, 3, 4)
    with pytest.raises(ValueError, match="packed rows only"):
        varlen.attention(torch.nn.Identity(), x, x, x, None, cu_seq_lens_q=torch.tensor([0, 3]), max_length_q=3)
    y = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="packed rows only"):
        varlen.attention(torch.nn.Identity(), y, y, y, None)
    with pytest.raises(ValueError, match="no dropout"):
        varlen.attention(torch.nn.Identity(), y, y, y, None, dropout=0.1, cu_seq_lens_q=torch.tensor([0, 3]), max_length_q=3)


def test_available_only_on_cuda() -> None:
    assert not varlen.available(torch.device("cpu"))


LENGTHS = (7, 12, 4, 9, 3)


def test_packed_forward_backward_on_the_varlen_kernel(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's packed forward_backward with attention switched to tb_varlen (the reference
    kernel standing in for CUDA's) equals the padded one, every layer called the kernel with the
    staged lengths, and the model's own implementation is back afterwards."""
    monkeypatch.setattr(varlen, "kernel", lambda: later_api)
    monkeypatch.setattr(packing, "flash_available", lambda base: True)
    monkeypatch.setattr(packing, "_flash_attn_installed", lambda: False)
    base = engine.registry.base("tiny")
    own = base.hf.config._attn_implementation
    vocab = base.vocab_size
    gen = torch.Generator().manual_seed(3)
    data = []
    for n in LENGTHS:
        data.append(datum(torch.randint(0, vocab, (n,), generator=gen).tolist(), torch.randint(0, vocab, (n,), generator=gen),
                          advantages=torch.randn(n, generator=gen), logprobs=-torch.rand(n, generator=gen) - 0.1))
    results = {}
    CALLS.clear()
    for layout in ("padded", "packed"):
        create(engine, layout, rank=4, seed=7)
        perturb(engine, layout, seed=8, scale=0.1)
        with overridden(layout=layout, max_batch_tokens=20):
            results[layout] = fb(engine, layout, "importance_sampling", data)
        if layout == "padded":
            assert CALLS == [], "padded micro-batches never run the varlen kernel"
    layers = base.hf.config.num_hidden_layers
    # packed groups of at most 20 real tokens: [7, 12] and [4, 9, 3], each through every layer
    assert [c["tokens"] for c in CALLS] == [19] * layers + [16] * layers
    assert CALLS[0]["heads"] == (base.hf.config.num_attention_heads, base.hf.config.num_key_value_heads)
    assert base.hf.config._attn_implementation == own
    for i in range(len(LENGTHS)):
        assert_close_up_to_summation_order(out_logprobs(results["packed"], i), out_logprobs(results["padded"], i), f"datum {i}")
    assert_close_up_to_summation_order(torch.tensor(results["packed"]["metrics"]["loss:sum"]),
                                       torch.tensor(results["padded"]["metrics"]["loss:sum"]), "loss:sum")
    for (name, want), got in zip(grads(engine, "padded").items(), grads(engine, "packed").values()):
        assert want is not None and got is not None, name
        assert_close_up_to_summation_order(got, want, f"grad {name}")


def test_position_ids_give_the_bounds_when_none_are_staged(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's padding-free forward passes one packed row with its position ids and no cumulative
    lengths: the kernel gets the bounds read from the positions (each sequence starting at 0), one
    host read per forward (the same bounds in every layer), and the row's logits equal each sequence's
    own forward up to float32 summation order."""
    monkeypatch.setattr(varlen, "kernel", lambda: later_api)
    hf = engine.registry.base("tiny").hf
    varlen.register()
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, engine.registry.base("tiny").vocab_size, (n,), generator=gen) for n in LENGTHS]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu, longest = varlen.bounds_from_positions(pos)
    assert cu.tolist() == [0, 7, 19, 23, 32, 35] and longest == 12 and cu.dtype == torch.int32
    assert varlen.bounds_from_positions(pos)[0] is cu, "the same position ids: the bounds read once"
    # A sequence whose positions do not restart at 0 (a continuation) still starts where they jump.
    assert varlen.bounds_from_positions(torch.tensor([[5, 6, 7, 0, 1, 9]]))[0].tolist() == [0, 3, 5, 6]
    own = hf.config._attn_implementation
    CALLS.clear()
    try:
        hf.config._attn_implementation = varlen.NAME
        with torch.no_grad():
            packed = hf(input_ids=ids, position_ids=pos).logits[0]
    finally:
        hf.config._attn_implementation = own
    layers = hf.config.num_hidden_layers
    assert [c["tokens"] for c in CALLS] == [sum(LENGTHS)] * layers
    with torch.no_grad():
        alone = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])
    assert_close_up_to_summation_order(packed, alone, "packed row vs each sequence alone")
