"""The verl engine's levers (tinker_engine_verl/levers.py) and its packed-row log-probabilities (compat.py).

The levers are a pure choice from a model's config, the GPU's memory and the settings; here they are
checked at the real Qwen3 shapes the GPU benches use (1.7B, 8B, 32B) against an H100's and an H200's
memory, and on CPU ranks. The parameter count the memory model uses is checked against the model
cards' sizes: Qwen3-1.7B 1.7B parameters, 1.4B of them outside the embeddings (tied to the output
layer, so counted once); Qwen3-8B 8.2B, 6.95B outside the embeddings (untied: input and output). The
cards round to two or three digits, hence 2%.
The end-to-end run with padding removed (verl on 2 CPU ranks, the same losses as padded) is
test/e2e/verl-ranks.test.ts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from tinker_engine_verl import levers
from tinker_engine_verl.compat import RowLogprobs

GIB = 1024**3
H100 = 81559 * 1024**2  # what torch reports as an H100 80GB's total memory (MiB)
H200 = 143771 * 1024**2

QWEN3_1_7B = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
QWEN3_8B = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
QWEN3_32B = Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def choose(config: Qwen3Config, gpu: int | None, *, ranks: int = 1, remove_padding: bool | None = None,
           grad_ckpt: bool | None = None, attn: str = "sdpa", ceiling: int = 16384, varlen: str | None = "tb_varlen",
           unpackable: str | None = None) -> levers.Levers:
    return levers.choose(levers.Shape.of(config), gpu_bytes=gpu, ranks=ranks, remove_padding=remove_padding,
                         grad_ckpt=grad_ckpt, attn=attn, ceiling=ceiling, varlen=varlen if gpu else None, unpackable=unpackable)


def test_parameter_count_of_the_published_shapes() -> None:
    small, large = levers.Shape.of(QWEN3_1_7B), levers.Shape.of(QWEN3_8B)
    assert small.params == pytest.approx(1.7e9, rel=0.02)
    assert small.params - small.vocab * small.hidden == pytest.approx(1.4e9, rel=0.02)
    assert large.params == pytest.approx(8.2e9, rel=0.02)
    assert large.params - 2 * large.vocab * large.hidden == pytest.approx(6.95e9, rel=0.02)


def test_cpu_ranks_keep_padding_and_checkpointing() -> None:
    lev = choose(QWEN3_1_7B, None)
    assert (lev.remove_padding, lev.attn, lev.grad_ckpt, lev.max_tokens) == (False, "sdpa", True, 16384)
    assert "on CPU ranks" in lev.describe()


def test_small_model_on_a_gpu_runs_packed_checkpointing_only_where_the_ceiling_needs_it() -> None:
    # Qwen3-1.7B: ~3.3 MB of activations per token without checkpointing, counted 1.5 times: 16384 tokens
    # (75 GiB) fit the H200 (98 GiB left after the weights): checkpointing off at the ceiling. The H100
    # (53 GiB left) would hold only 8192 tokens without it: checkpointing on, at the whole ceiling
    # (1.1 MB per token counted 1.5 times: 25 GiB).
    for gpu, ckpt in ((H100, True), (H200, False)):
        lev = choose(QWEN3_1_7B, gpu)
        assert (lev.remove_padding, lev.attn, lev.grad_ckpt, lev.max_tokens) == (True, "tb_varlen", ckpt, 16384), lev.describe()
    assert "without it the micro-batch would be lowered" in choose(QWEN3_1_7B, H100).describe()
    assert "the whole ceiling fits without it" in choose(QWEN3_1_7B, H200).describe()
    # a smaller ceiling that fits without checkpointing on the H100: off
    small = choose(QWEN3_1_7B, H100, ceiling=8192)
    assert (small.grad_ckpt, small.max_tokens) == (False, 8192), small.describe()
    # flash-attn's own attention, where the operator chose it, is kept
    assert choose(QWEN3_1_7B, H200, attn="flash_attention_2").attn == "flash_attention_2"
    # no variable-length kernel (a torch without varlen_attn, eager attention): padding kept
    assert not choose(QWEN3_1_7B, H200, varlen=None).remove_padding
    assert not choose(QWEN3_1_7B, H200, attn="eager").remove_padding


def test_8b_keeps_the_micro_batch_and_checkpoints() -> None:
    # The 8B shape's activations are ~6.7 MB per token without checkpointing: 16384 tokens fit neither
    # GPU without it, so checkpointing goes on (1.4 MB per token, counted 1.5 times): the whole ceiling
    # on the H200 (75 GiB left after the float32 weights' 30.5 GiB), 8192 tokens on the H100 (29 GiB left).
    per_token = levers.Shape.of(QWEN3_8B).token_bytes(False)
    assert 6.5e6 < per_token < 7.0e6
    h200, h100 = choose(QWEN3_8B, H200), choose(QWEN3_8B, H100)
    assert (h200.grad_ckpt, h200.max_tokens) == (True, 16384), h200.describe()
    assert (h100.grad_ckpt, h100.max_tokens) == (True, 8192), h100.describe()
    assert "lowered from TB_ENGINE_MAX_BATCH_TOKENS=16384" in h100.describe()
    # Two ranks halve the weights per rank (44.5 GiB left on an H100): the whole ceiling with checkpointing.
    two = choose(QWEN3_8B, H100, ranks=2)
    assert (two.grad_ckpt, two.max_tokens) == (True, 16384), two.describe()
    # Checkpointing asked for on the H100: the same 8192 tokens.
    asked = choose(QWEN3_8B, H100, grad_ckpt=True)
    assert (asked.grad_ckpt, asked.max_tokens) == (True, 8192), asked.describe()
    # Checkpointing off asked for on the H200: the largest micro-batch that fits without it, 4096 tokens (39 GiB).
    forced = choose(QWEN3_8B, H200, grad_ckpt=False)
    assert (forced.grad_ckpt, forced.max_tokens) == (False, 4096), forced.describe()


def test_padding_kept_counts_the_padded_tokens() -> None:
    # Padding kept, the micro-batch computes up to twice its real tokens (levers.PADDED_TOKENS). On the H100
    # at the 1.7B shape without checkpointing, 8192 real tokens were measured at a 57.3 GiB peak, 2.3x the
    # estimate of 8192 computed tokens (24.9 GiB): counted twice and with the headroom (74.6 GiB) they do
    # not fit the 52 GiB left, so the plan lowers the micro-batch to 4096 (37.3 GiB).
    nockpt = choose(QWEN3_1_7B, H100, remove_padding=False, grad_ckpt=False, ceiling=8192)
    assert (nockpt.remove_padding, nockpt.grad_ckpt, nockpt.max_tokens) == (False, False, 4096), nockpt.describe()
    assert "padded tokens counted 2x" in nockpt.describe()
    # With checkpointing (measured 25.5 GiB at 16384 padded, mixed lengths), counted twice the whole ceiling
    # still fits (50.8 of 52 GiB), and auto keeps checkpointing on.
    ckpt = choose(QWEN3_1_7B, H100, remove_padding=False)
    assert (ckpt.grad_ckpt, ckpt.max_tokens) == (True, 16384), ckpt.describe()
    # Padding removed: no factor.
    assert "padded tokens" not in choose(QWEN3_1_7B, H100).describe()


def test_too_large_for_the_gpu_says_so() -> None:
    lev = choose(QWEN3_32B, H100)  # 131 GB of float32 weights on one 80 GB GPU
    assert (lev.grad_ckpt, lev.max_tokens) == (True, 1024)
    assert "may not fit" in lev.describe()
    # Over 8 ranks the weights fit (15.3 GiB per rank); its 19 MB per token without checkpointing do not
    # at 4096 tokens, so checkpointing goes on, at the whole ceiling (2.8 MB per token counted: 43 GiB).
    spread = choose(QWEN3_32B, H100, ranks=8)
    assert (spread.grad_ckpt, spread.max_tokens) == (True, 16384), spread.describe()
    assert "may not fit" not in spread.describe()


def test_settings_win_and_a_smaller_ceiling_is_kept() -> None:
    lev = choose(QWEN3_1_7B, H200, remove_padding=False, grad_ckpt=True, ceiling=2048)
    assert (lev.remove_padding, lev.grad_ckpt, lev.max_tokens) == (False, True, 2048)
    assert "TB_VERL_REMOVE_PADDING" in lev.describe() and "TB_VERL_GRAD_CKPT" in lev.describe()
    on_cpu = choose(QWEN3_1_7B, None, remove_padding=True, grad_ckpt=False)
    assert (on_cpu.remove_padding, on_cpu.attn, on_cpu.grad_ckpt) == (True, "sdpa", False)
    assert "block-diagonal mask" in on_cpu.describe()
    veomni = choose(QWEN3_1_7B, H200, remove_padding=True, unpackable="the VeOmni strategy")
    assert not veomni.remove_padding and "VeOmni" in veomni.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_logprobs_equal_log_softmax(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """RowLogprobs, in chunks smaller than the row count, against ``log_softmax(x.float()).gather``:
    the forward and the logits' gradient. Both compute the same float32 terms per row; only the
    blocking of each row's sum over the vocabulary may differ (a log-sum-exp over V=1000 terms: a few
    ulps of float32), hence 1e-5 relative and 1e-6 absolute on values of magnitude ~7. A bf16 input's
    gradient is those float32 values rounded to bf16: two values a few float32 ulps apart may round to
    neighbouring bf16 values, one bf16 step apart (2^-7 relative at most), so there the bound is 2^-7."""
    monkeypatch.setattr("tinker_engine_verl.compat.CHUNK_ELEMENTS", 3 * 1000)  # 3 rows per chunk
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 1000, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 1000, (10,), generator=gen)
    weights = torch.randn(10, generator=gen)
    got = RowLogprobs.apply(logits, labels)
    (got * weights).sum().backward()
    got_grad, logits.grad = logits.grad, None
    want = F.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    (want * weights).sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grad.dtype == dtype
    grad_rtol = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(got_grad.float(), logits.grad.float(), rtol=grad_rtol, atol=1e-6)
