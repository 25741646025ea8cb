"""Target logprobs through the output layer in chunks (chunked_logprobs.py) against the unfused path
(the full logits, then logprobs.target_logprobs), on the tiny model's output layer with its LoRA.

Each chunk's logits are the same per-token dot products as the full logits' (a token's logits do not
depend on the other tokens), and its log-softmax is the same per-row reduction, so the forward agrees
to float32 rounding of matmuls blocked over fewer rows (helpers.ORDER_SLACK). The backward sums the
chunks' contributions to the output layer's LoRA gradients in another order (chunk by chunk instead
of one matmul over every token): again ORDER_SLACK of the tensor's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_up_to_summation_order, create, perturb
from tinker_engine.chunked_logprobs import head_target_logprobs, plain_linear_head
from tinker_engine.engine import Engine
from tinker_engine.logprobs import target_logprobs

N = 23


def _setup(engine: Engine) -> tuple[torch.nn.Module, torch.Tensor, list[torch.nn.Parameter], int]:
    create(engine, "h", rank=4, seed=2)
    perturb(engine, "h", seed=3, scale=0.1)
    base = engine.registry.base("tiny")
    model = engine.registry.model("h")
    base.activate(model.adapter, trainable=True)
    head = base.hf.get_output_embeddings()
    lora = [p for n, p in model.params if "lm_head" in n]
    assert lora, "the adapter trains the output layer (train_unembed)"
    hidden = torch.randn(N, base.hf.config.hidden_size, generator=torch.Generator().manual_seed(4))
    return head, hidden, lora, base.vocab_size


def _run(fn, head, hidden, targets, weights, lora):
    h = hidden.clone().requires_grad_(True)
    for p in lora:
        p.grad = None
    lp = fn(h, head, targets)
    (lp * weights).sum().backward()
    return lp.detach(), h.grad.clone(), [p.grad.clone() for p in lora]


def _unfused(h: torch.Tensor, head, targets: torch.Tensor) -> torch.Tensor:
    return target_logprobs(head(h), targets)


@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("chunk", [1, 5, N, 64])
def test_chunked_equals_unfused(engine: Engine, k: int | None, chunk: int) -> None:
    head, hidden, lora, vocab = _setup(engine)
    gen = torch.Generator().manual_seed(5)
    shape = (N,) if k is None else (N, k)
    targets = torch.randint(0, vocab, shape, generator=gen)
    weights = torch.randn(shape, generator=gen)
    want = _run(_unfused, head, hidden, targets, weights, lora)
    got = _run(lambda h, hd, t: head_target_logprobs(h, hd, t, chunk=chunk), head, hidden, targets, weights, lora)
    assert got[0].shape == shape and got[0].dtype == torch.float32
    assert_close_up_to_summation_order(got[0], want[0], "logprobs")
    assert_close_up_to_summation_order(got[1], want[1], "hidden grad")
    for g, w in zip(got[2], want[2]):
        assert float(w.abs().max()) > 0
        assert_close_up_to_summation_order(g, w, "output layer LoRA grad")


def test_no_full_logits_are_kept_for_the_backward(engine: Engine) -> None:
    """What autograd keeps between the forward and the backward: with chunks of 5 tokens, no tensor
    with more than 5 x vocab elements (the unfused path keeps the N x vocab logits)."""
    head, hidden, lora, vocab = _setup(engine)
    targets = torch.randint(0, vocab, (N,), generator=torch.Generator().manual_seed(6))

    def largest_saved(fn) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        h = hidden.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp = fn(h, head, targets)
        lp.sum().backward()
        return max(sizes)

    assert largest_saved(_unfused) >= N * vocab
    assert largest_saved(lambda h, hd, t: head_target_logprobs(h, hd, t, chunk=5)) <= 5 * vocab


def test_the_tiny_model_has_a_plain_linear_head(engine: Engine) -> None:
    assert plain_linear_head(engine.registry.base("tiny").hf)


def test_chunk_must_be_positive(engine: Engine) -> None:
    head, hidden, _, vocab = _setup(engine)
    with pytest.raises(ValueError, match="chunk"):
        head_target_logprobs(hidden, head, torch.zeros(N, dtype=torch.int64), chunk=0)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_forward_backward_with_small_chunks_equals_whole_logits(engine: Engine, layout: str) -> None:
    """The engine's forward_backward with 3-token output-layer chunks (recomputed in the backward)
    against whole logits (one chunk, nothing recomputed): 1-D and (N, K) targets, weights."""
    from helpers import datum, fb, grads, out_logprobs
    from tinker_engine.settings import overridden

    vocab = engine.registry.base("tiny").vocab_size
    gen = torch.Generator().manual_seed(8)
    data = []
    for n, k in ((7, None), (11, 2), (4, None)):
        shape = (n,) if k is None else (n, k)
        data.append(datum(torch.randint(0, vocab, (n,), generator=gen).tolist(), torch.randint(0, vocab, shape, generator=gen),
                          weights=torch.rand(shape, generator=gen)))
    results = {}
    for name, chunk in (("whole", 1 << 30), ("small", 3)):
        create(engine, name, rank=4, seed=2)
        perturb(engine, name, seed=3, scale=0.1)
        with overridden(layout=layout, head_chunk_tokens=chunk):
            results[name] = fb(engine, name, "cross_entropy", data)
    for i in range(len(data)):
        assert_close_up_to_summation_order(out_logprobs(results["small"], i), out_logprobs(results["whole"], i), f"datum {i}")
    assert_close_up_to_summation_order(torch.tensor(results["small"]["metrics"]["loss:sum"]),
                                       torch.tensor(results["whole"]["metrics"]["loss:sum"]), "loss:sum")
    for (n, want), got in zip(grads(engine, "whole").items(), grads(engine, "small").values()):
        assert want is not None and got is not None and float(want.abs().max()) > 0, n
        assert_close_up_to_summation_order(got, want, n)
