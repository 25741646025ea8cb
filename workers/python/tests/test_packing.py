"""Packed micro-batches (packing.py) against padded ones: every loss of the registry, 1-D and (N, K)
targets, the same logprobs, loss sums and accumulated gradients up to float32 summation order.

Why only summation order may differ: a packed row and a padded batch run the same per-token
computations (embeddings, norms, MLPs and projections are per token; rotary embeddings read the
same position ids, restarting per datum); attention sees exactly the same keys per query (SDPA's
block-diagonal mask multiplies every other datum's scores by exactly 0 after the max subtraction,
adding exact zeros). What changes is the blocking of the reductions: the matmuls run over a (1, T)
row instead of (B, L) rows, SDPA's key blocks start at other positions (the online softmax rescales
at other points), and the LoRA gradients sum over T tokens instead of B x L rows (pads add exact
zeros). Each is a float32 reduction of the same terms in another order, bounded by
``helpers.ORDER_SLACK`` (256 u of the tensor's largest magnitude; the chain here is 2 layers deep
with reductions of at most 128 terms, ~n u each, observed well below). A datum seeing another's
tokens, a position id not restarting, or a datum dropped moves logprobs by O(0.1) or more
(``test_packed_row_without_restarts_differs`` shows the mask and the restarts matter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import assert_close_up_to_summation_order, create, datum, fb, grads, out_logprobs, perturb
from tinker_engine.engine import Engine
from tinker_engine.losses import LOSSES
from tinker_engine.packing import packed_groups, padded_groups
from tinker_engine.settings import overridden
from tinker_engine.train import Datum

LENGTHS = (7, 12, 4, 9, 3)
# 20 tokens: packed groups [7, 12] [4, 9, 3]; padded groups [7] [12] [4, 9] [3] (count x longest <= 20).
BUDGET = 20


def _value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A valid value of loss input ``name`` (every name a loss of the catalogue takes)."""
    if name in ("logprobs", "stability_logprobs"):
        return -torch.rand(shape, generator=gen) * 2.0 - 0.1
    if name == "advantages":
        return torch.randn(shape, generator=gen)
    if name in ("weights",):
        return torch.rand(shape, generator=gen)
    if name in ("sequence_ratio_mask", "stability_mask"):
        return torch.ones(shape)
    if name in ("clip_low_threshold",):
        return torch.full(shape, 0.6)
    if name in ("clip_high_threshold",):
        return torch.full(shape, 1.5)
    raise AssertionError(f"test_packing has no value for loss input '{name}': add one")


def _data(loss: str, vocab: int, k: int | None, seed: int) -> list[dict[str, Any]]:
    spec = LOSSES[loss]
    gen = torch.Generator().manual_seed(seed)
    data = []
    for n in LENGTHS:
        shape = (n,) if k is None else (n, k)
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        targets = torch.randint(0, vocab, shape, generator=gen)
        inputs = {name: _value(name, shape, gen) for name in spec.required_inputs + spec.optional_inputs}
        data.append(datum(tokens, targets, **inputs))
    return data


def _config(loss: str) -> dict[str, float]:
    """A value for every config key the loss requires (no default): 0.5 is within every bound."""
    return {key: 0.5 for key, default in LOSSES[loss].config.items() if default is None}


CASES = [(name, None) for name in LOSSES] + [(name, 3) for name, spec in LOSSES.items() if spec.allows_topk]


@pytest.mark.parametrize(("loss", "k"), CASES, ids=[f"{n}-{'1d' if k is None else f'k{k}'}" for n, k in CASES])
def test_packed_equals_padded(engine: Engine, loss: str, k: int | None) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    results = {}
    for layout in ("padded", "packed"):
        create(engine, layout, rank=4, seed=7)
        perturb(engine, layout, seed=8, scale=0.1)
        with overridden(layout=layout, max_batch_tokens=BUDGET):
            results[layout] = fb(engine, layout, loss, _data(loss, vocab, k, seed=3), _config(loss))
    padded, packed = results["padded"], results["packed"]
    for i, n in enumerate(LENGTHS):
        want = out_logprobs(padded, i)
        assert want.shape == ((n,) if k is None else (n, k))
        assert_close_up_to_summation_order(out_logprobs(packed, i), want, f"datum {i} logprobs")
    loss_scale = torch.tensor(padded["metrics"]["loss:sum"])
    assert_close_up_to_summation_order(torch.tensor(packed["metrics"]["loss:sum"]), loss_scale, "loss:sum")
    nonzero = 0
    for (name, want), got in zip(grads(engine, "padded").items(), grads(engine, "packed").values()):
        assert want is not None and got is not None, name
        assert_close_up_to_summation_order(got, want, f"grad {name}")
        nonzero += int(bool(want.abs().max() > 0))
    assert nonzero > 0, "some gradient must be nonzero for the comparison to mean anything"


def test_packed_row_without_restarts_differs(engine: Engine) -> None:
    """The comparison above can fail: the same packed row with position ids running on (one long
    sequence, every datum seeing those before it) gives the later datums other logprobs."""
    create(engine, "m", seed=7)
    base = engine.registry.base("tiny")
    model = engine.registry.model("m")
    base.activate(model.adapter)
    vocab = base.vocab_size
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, vocab, (6,), generator=gen), torch.randint(0, vocab, (5,), generator=gen)
    row = torch.cat([a, b]).unsqueeze(0)
    restart = torch.cat([torch.arange(6), torch.arange(5)]).unsqueeze(0)
    with torch.no_grad():
        alone = base.hf(input_ids=b.unsqueeze(0), use_cache=False).logits[0]
        packed = base.hf(input_ids=row, position_ids=restart, use_cache=False).logits[0, 6:]
        running = base.hf(input_ids=row, use_cache=False).logits[0, 6:]
    assert_close_up_to_summation_order(packed, alone, "datum b packed")
    assert float((running - alone).abs().max()) > 1e-2


def _datums(lengths: list[int]) -> list[Datum]:
    return [Datum(i, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), {}) for i, n in enumerate(lengths)]


def test_micro_batches_by_tokens() -> None:
    lengths = [7, 12, 4, 9, 3, 30, 1]
    packed = [[d.tokens.shape[0] for d in g] for g in packed_groups(_datums(lengths), 20)]
    assert packed == [[7, 12], [4, 9, 3], [30], [1]]  # a datum over the budget: alone
    padded = [[d.tokens.shape[0] for d in g] for g in padded_groups(_datums(lengths), 20)]
    assert padded == [[7], [12], [4, 9], [3], [30], [1]]
    # Every datum once, in order.
    assert [d.index for g in packed_groups(_datums(lengths), 20) for d in g] == list(range(len(lengths)))


def test_auto_packs_where_attention_is_variable_length(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_engine import packing
    from tinker_engine.settings import EngineSettings

    base = engine.registry.base("tiny")
    assert EngineSettings().layout == "auto"
    assert not packing.isolates_datums(base)  # the CPU: no flash-attn
    assert packing.resolve("auto", base).name == "padded"
    assert packing.resolve("packed", base).name == "packed"
    monkeypatch.setattr(packing, "isolates_datums", lambda b: True)
    assert packing.resolve("auto", base).name == "packed"
    # Given the op's datums, auto packs only where padding them would cost at least AUTO_PACK_PADDING.
    equal, mixed = _datums([256, 256, 256, 256]), _datums([64, 2048, 300, 900])
    assert packing.padding_share(equal, 4096) == 0.0
    assert packing.resolve("auto", base, equal, 4096).name == "padded"
    # Padded in rows of the longest within the budget: [64, 2048] as 2 x 2048, [300, 900] as 2 x 900.
    assert packing.padding_share(mixed, 4096) == pytest.approx((2 * 2048 + 2 * 900 - 3312) / 3312)
    assert packing.resolve("auto", base, mixed, 4096).name == "packed"
    just_under = _datums([100, 124])  # (2 x 124 - 224) / 224 = 0.107
    assert packing.resolve("auto", base, just_under, 4096).name == "padded"
    # An explicit setting is kept whatever the datums.
    assert packing.resolve("packed", base, equal, 4096).name == "packed"
    assert packing.resolve("padded", base, mixed, 4096).name == "padded"


def test_packed_staging(engine: Engine) -> None:
    """A packed row: the datums' tokens in order, position ids restarting, slots, flat targets, and
    the variable-length kernel's arguments as transformers derives them from the position ids."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from tinker_engine.packing import stage_packed, stage_padded

    lengths = [3, 5, 2]
    datums = [Datum(i, torch.arange(n) + 10 * i, torch.arange(n) + 100 * i, {}) for i, n in enumerate(lengths)]
    staged = stage_packed(datums, torch.device("cpu"))
    assert staged.packed and staged.ids.shape == (1, 10)
    assert staged.ids[0].tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 20, 21]
    assert staged.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert staged.slots == [(0, 3), (3, 8), (8, 10)]
    assert staged.targets.tolist() == [0, 1, 2, 100, 101, 102, 103, 104, 200, 201]
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(staged.position_ids)
    assert torch.equal(staged.varlen["cu_seq_lens_q"], cu_q) and torch.equal(staged.varlen["cu_seq_lens_k"], cu_k)
    assert staged.varlen["max_length_q"] == int(max_q) == staged.varlen["max_length_k"] == int(max_k)
    padded = stage_padded(datums, torch.device("cpu"))
    assert not padded.packed and padded.ids.shape == (3, 5) and padded.slots == [(0, 5), (5, 10), (10, 15)]
    assert padded.targets[5:10].tolist() == [100, 101, 102, 103, 104] and padded.targets[3:5].tolist() == [0, 0]


def test_attention_for_the_packed_row(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA here: no extra arguments (the mask comes from the position ids). Where a variable-length
    kernel runs (not on this machine: the switch is recorded, not run), the forward gets the
    variable-length arguments under flash_attention_2 (flash-attn installed) or tb_varlen (torch's
    kernel), and the model's own implementation is back afterwards."""
    from tinker_engine import packing

    base = engine.registry.base("tiny")
    datums = [Datum(i, torch.arange(n), torch.arange(n), {}) for i, n in enumerate([3, 4])]
    staged = packing.stage_packed(datums, torch.device("cpu"))
    with packing.attention_for(base, staged) as extra:
        assert extra == {}
    with packing.attention_for(base, packing.stage_padded(datums, torch.device("cpu"))) as extra:
        assert extra == {}
    own = base.hf.config._attn_implementation
    calls: list[str] = []
    monkeypatch.setattr(packing, "flash_available", lambda b: True)
    monkeypatch.setattr(base.hf, "set_attn_implementation", calls.append)
    monkeypatch.setattr(packing, "_flash_attn_installed", lambda: True)
    with packing.attention_for(base, staged) as extra:
        assert extra is staged.varlen
        assert calls == ["flash_attention_2"]
    assert calls == ["flash_attention_2", own]
    monkeypatch.setattr(packing, "_flash_attn_installed", lambda: False)  # torch's kernel (test_varlen.py)
    with packing.attention_for(base, staged) as extra:
        assert extra is staged.varlen
    assert calls[2:] == ["tb_varlen", own]
