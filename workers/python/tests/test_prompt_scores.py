"""target_prompt_logprobs: the logprobs of requested ids at each prompt position, checked against
the engine's own prompt logprobs and top-K from the same request."""

from __future__ import annotations

import pytest
import torch

from helpers import BASE, sampling
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError

PROMPT = [12, 400, 7, 88, 301, 5, 977, 64]


def _sample(engine: Engine, targets: dict | None, topk: int = 3) -> dict:
    return engine.call("sample", {"base_model": BASE, "adapter_dir": None, "prompt": PROMPT, "num_samples": 1,
                                  "sampling_params": sampling(max_tokens=2), "prompt_logprobs": True,
                                  "topk_prompt_logprobs": topk, "target_prompt_logprobs": targets})


def test_target_prompt_logprobs_match_prompt_and_topk_logprobs(engine: Engine) -> None:
    ref = _sample(engine, None)
    rows = len(PROMPT) - 1
    ids: list[int] = []
    for i in range(rows):
        top2 = ref["topk_prompt_logprobs"][i + 1][1][0]  # the second most likely id at position i + 1
        ids += [PROMPT[i + 1], top2, -1]
    out = _sample(engine, {"k": 3, "ids": ids})
    got = out["target_prompt_logprobs"]
    assert list(got.shape) == [rows, 3] and got.dtype == torch.float32
    for i in range(rows):
        row = got[i].tolist()
        assert row[0] == pytest.approx(ref["prompt_logprobs"][i + 1], abs=1e-6)
        assert row[1] == pytest.approx(ref["topk_prompt_logprobs"][i + 1][1][1], abs=1e-6)
        assert row[2] == 0.0  # -1 requests nothing


def test_target_prompt_logprobs_alone(engine: Engine) -> None:
    ref = _sample(engine, None)
    out = engine.call("sample", {"base_model": BASE, "adapter_dir": None, "prompt": PROMPT, "num_samples": 1,
                                 "sampling_params": sampling(max_tokens=2),
                                 "target_prompt_logprobs": {"k": 1, "ids": PROMPT[1:]}})
    assert out["prompt_logprobs"] is None and out["topk_prompt_logprobs"] is None
    assert out["target_prompt_logprobs"].flatten().tolist() == pytest.approx(ref["prompt_logprobs"][1:], abs=1e-6)


def test_target_prompt_logprobs_checks(engine: Engine) -> None:
    with pytest.raises(UserError, match="shape \\[7, 2\\] needs 14"):
        _sample(engine, {"k": 2, "ids": [1] * 7})
    with pytest.raises(UserError, match="outside the vocabulary"):
        _sample(engine, {"k": 1, "ids": [1] * 6 + [10**6]})


def test_topk_sample_logprobs_match_the_sampled_distribution(engine: Engine) -> None:
    """Each generated token's top-K comes from the distribution it was drawn from: its own logprob
    is in the list when it ranks within K, and never exceeds the first entry."""
    for params in (sampling(max_tokens=6, temperature=0.0), sampling(max_tokens=6, temperature=0.7, top_k=20)):
        out = engine.call("sample", {"base_model": BASE, "adapter_dir": None, "prompt": PROMPT, "num_samples": 2,
                                     "sampling_params": params, "topk_sample_logprobs": 5})
        for seq in out["sequences"]:
            assert len(seq["topk_logprobs"]) == len(seq["tokens"])
            for tok, lp, row in zip(seq["tokens"], seq["logprobs"], seq["topk_logprobs"]):
                assert len(row) == 5
                assert [v for _, v in row] == sorted((v for _, v in row), reverse=True)
                assert lp <= row[0][1] + 1e-6
                ids = [i for i, _ in row]
                if params["temperature"] == 0.0:
                    assert ids[0] == tok and row[0][1] == pytest.approx(lp, abs=1e-6)  # greedy: the argmax
                if tok in ids:
                    assert row[ids.index(tok)][1] == pytest.approx(lp, abs=1e-6)
    plain = engine.call("sample", {"base_model": BASE, "adapter_dir": None, "prompt": PROMPT, "num_samples": 1,
                                   "sampling_params": sampling(max_tokens=2)})
    assert "topk_logprobs" not in plain["sequences"][0]


def _alt(engine: Engine, k: int, temperature: float, seed: int | None = 4) -> dict:
    return engine.call("sample", {"base_model": BASE, "adapter_dir": None, "prompt": PROMPT, "num_samples": 1,
                                  "sampling_params": sampling(max_tokens=2, temperature=temperature, seed=seed),
                                  "prompt_logprobs": True, "topk_prompt_logprobs": 1, "prompt_alt_tokens_k": k})


def test_prompt_alt_tokens_greedy_is_the_argmax(engine: Engine) -> None:
    out = _alt(engine, 3, 0.0)
    alt = out["prompt_alt_tokens"]
    rows = len(PROMPT) - 1
    assert list(alt["tokens"].shape) == [rows, 3] == list(alt["logprobs"].shape)
    assert alt["tokens"].dtype == torch.int64 and alt["logprobs"].dtype == torch.float32
    for i in range(rows):
        top_id, top_lp = out["topk_prompt_logprobs"][i + 1][0]
        assert alt["tokens"][i].tolist() == [top_id] * 3
        assert alt["logprobs"][i].tolist() == pytest.approx([top_lp] * 3, abs=1e-6)


def test_prompt_alt_tokens_draws_are_scored_in_their_distribution(engine: Engine) -> None:
    import torch
    temperature = 0.8
    out = _alt(engine, 16, temperature)
    again = _alt(engine, 16, temperature)
    assert all(torch.equal(out["prompt_alt_tokens"][k], again["prompt_alt_tokens"][k]) for k in ("tokens", "logprobs"))  # seeded
    assert out["sequences"] == _sample_plain(engine, temperature)["sequences"]  # draws leave the sampling stream alone
    base = engine.registry.base(BASE)
    base.activate(None)
    with torch.no_grad():
        logits = base.hf(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    toks = out["prompt_alt_tokens"]["tokens"]
    assert list(toks.shape) == [len(PROMPT) - 1, 16]
    ref = logp.gather(-1, toks)
    got = out["prompt_alt_tokens"]["logprobs"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert len(set(toks.flatten().tolist())) > 16  # real draws, not one repeated token


def _sample_plain(engine: Engine, temperature: float) -> dict:
    return engine.call("sample", {"base_model": BASE, "adapter_dir": None, "prompt": PROMPT, "num_samples": 1,
                                  "sampling_params": sampling(max_tokens=2, temperature=temperature, seed=4)})
