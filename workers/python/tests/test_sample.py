"""Sampling semantics: seeds, greedy, stops, logprobs, prompt logprobs and saved adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from helpers import create, datum, fb, out_logprobs, perturb, sample, sampling
from tinker_engine.channel import encode_frame
from tinker_engine.device import Placement
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError
from tinker_engine.sample import sampling_distribution

PROMPT = [12, 400, 7, 88, 301, 5, 977, 64]


def safetensors_keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _base_logp(engine: Engine, tokens: list[int], adapter: str | None = None) -> torch.Tensor:
    """Full-sequence (no cache) float32 log-softmax of the active model at every position."""
    base = engine.registry.base("tiny")
    base.activate(adapter)
    with torch.no_grad():
        return torch.log_softmax(base.hf(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def _greedy_by_hand(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    lps: list[float] = []
    for _ in range(n):
        logp = _base_logp(engine, prompt + tokens)[-1]
        tok = int(logp.argmax())
        tokens.append(tok)
        lps.append(float(logp[tok]))
    return tokens, lps


def test_same_seed_same_tokens(engine: Engine) -> None:
    a = sample(engine, PROMPT, sampling(max_tokens=12, seed=123), num_samples=3)
    b = sample(engine, PROMPT, sampling(max_tokens=12, seed=123), num_samples=3)
    c = sample(engine, PROMPT, sampling(max_tokens=12, seed=124), num_samples=3)
    assert a["sequences"] == b["sequences"]
    assert [s["tokens"] for s in a["sequences"]] != [s["tokens"] for s in c["sequences"]]
    assert len({tuple(s["tokens"]) for s in a["sequences"]}) == 3  # the samples differ from each other
    unseeded = [sample(engine, PROMPT, sampling(max_tokens=12, seed=None))["sequences"][0]["tokens"] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_temperature_zero_is_greedy(engine: Engine) -> None:
    expected_tokens, expected_lps = _greedy_by_hand(engine, PROMPT, 10)
    result = sample(engine, PROMPT, sampling(max_tokens=10, temperature=0.0, seed=None), num_samples=2)
    for seq in result["sequences"]:
        assert seq["tokens"] == expected_tokens
        assert seq["stop_reason"] == "length"
        torch.testing.assert_close(torch.tensor(seq["logprobs"]), torch.tensor(expected_lps), rtol=1e-5, atol=1e-5)


def test_sampled_logprobs_at_temperature_one(engine: Engine) -> None:
    result = sample(engine, PROMPT, sampling(max_tokens=10, seed=7), num_samples=3)
    for seq in result["sequences"]:
        full = _base_logp(engine, PROMPT + seq["tokens"])
        expected = [float(full[len(PROMPT) - 1 + i, t]) for i, t in enumerate(seq["tokens"])]
        torch.testing.assert_close(torch.tensor(seq["logprobs"]), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_logprobs_come_from_the_truncated_distribution(engine: Engine) -> None:
    temperature, k = 0.7, 5
    result = sample(engine, PROMPT, sampling(max_tokens=6, temperature=temperature, top_k=k, seed=3), num_samples=2)
    for seq in result["sequences"]:
        full = _base_logp(engine, PROMPT + seq["tokens"])
        for i, tok in enumerate(seq["tokens"]):
            scaled = full[len(PROMPT) - 1 + i] / temperature
            top = scaled.topk(k)
            assert tok in top.indices.tolist()
            expected = float(scaled[tok] - torch.logsumexp(top.values, dim=0))
            assert seq["logprobs"][i] == pytest.approx(expected, abs=1e-5)


def test_sampling_distribution_top_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logp = sampling_distribution(probs.log(), temperature=1.0, top_k=-1, top_p=0.75)
    kept = logp.exp()
    torch.testing.assert_close(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # The top token survives any top_p; top_k applies before top_p.
    assert sampling_distribution(probs.log(), 1.0, -1, 0.1).exp()[0, 0] == pytest.approx(1.0)
    # top_p sees the top-k-renormalised probabilities: [0.526, 0.316, 0.158] after top_k=3, so at
    # top_p=0.82 the third token goes (0.842 before it), while top_p alone keeps it (0.8 before it).
    both = sampling_distribution(probs.log(), 1.0, 3, 0.82).exp()
    torch.testing.assert_close(both, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    only_p = sampling_distribution(probs.log(), 1.0, -1, 0.82).exp()
    torch.testing.assert_close(only_p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    hot = sampling_distribution(probs.log(), 2.0, -1, 1.0).exp()
    torch.testing.assert_close(hot, (probs.sqrt() / probs.sqrt().sum()))


def _first_new(tokens: list[int]) -> int:
    return next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_is_included_and_ends_the_sequence(engine: Engine) -> None:
    greedy, _ = _greedy_by_hand(engine, PROMPT, 12)
    i = _first_new(greedy)
    result = sample(engine, PROMPT, sampling(max_tokens=12, temperature=0.0, stop_tokens=[greedy[i]]))
    seq = result["sequences"][0]
    assert seq["tokens"] == greedy[: i + 1]
    assert seq["stop_reason"] == "stop"
    assert len(seq["logprobs"]) == i + 1


def test_eos_stops(engine: Engine) -> None:
    greedy, _ = _greedy_by_hand(engine, PROMPT, 12)
    i = _first_new(greedy)
    engine.registry.base("tiny").eos_token_id = greedy[i]
    seq = sample(engine, PROMPT, sampling(max_tokens=12, temperature=0.0))["sequences"][0]
    assert seq["tokens"] == greedy[: i + 1] and seq["stop_reason"] == "stop"
    no_eos = {**sampling(max_tokens=12, temperature=0.0), "stop_at_eos": False}
    seq = sample(engine, PROMPT, no_eos)["sequences"][0]
    assert seq["tokens"] == greedy and seq["stop_reason"] == "length"


def test_stop_string(engine: Engine) -> None:
    tok = engine.registry.base("tiny").tokenizer
    greedy, _ = _greedy_by_hand(engine, PROMPT, 16)
    # A stop string that spans a token boundary: the last char of token i + the first of token i+1.
    def usable(text: str) -> bool:
        return bool(text.strip()) and text.isascii()

    i = next(i for i in range(2, 14) if usable(tok.decode([greedy[i]])) and usable(tok.decode([greedy[i + 1]])))
    stop = tok.decode([greedy[i]])[-1] + tok.decode([greedy[i + 1]])[0]
    expected_len = next(j + 1 for j in range(len(greedy)) if stop in tok.decode(greedy[: j + 1]))
    assert expected_len < 16
    seq = sample(engine, PROMPT, sampling(max_tokens=16, temperature=0.0, stop_strings=["zzzz-never", stop]))["sequences"][0]
    assert seq["tokens"] == greedy[:expected_len]
    assert seq["stop_reason"] == "stop"


def test_max_tokens_gives_length(engine: Engine) -> None:
    result = sample(engine, PROMPT, sampling(max_tokens=5, seed=1), num_samples=4)
    for seq in result["sequences"]:
        assert seq["stop_reason"] == "length"
        assert len(seq["tokens"]) == len(seq["logprobs"]) == 5
    one = sample(engine, PROMPT, sampling(max_tokens=1, temperature=0.0))["sequences"][0]
    assert len(one["tokens"]) == 1 and one["stop_reason"] == "length"


def test_prompt_logprobs_match_a_direct_forward(engine: Engine) -> None:
    result = sample(engine, PROMPT, sampling(max_tokens=1), prompt_logprobs=True, topk=3)
    logp = _base_logp(engine, PROMPT)
    expected = [float(logp[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    assert result["prompt_logprobs"][0] is None
    torch.testing.assert_close(torch.tensor(result["prompt_logprobs"][1:]), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    tops = result["topk_prompt_logprobs"]
    assert tops[0] is None and len(tops) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        values, ids = logp[i - 1].topk(3)
        assert [pair[0] for pair in tops[i]] == ids.tolist()
        torch.testing.assert_close(torch.tensor([pair[1] for pair in tops[i]]), values, rtol=1e-5, atol=1e-5)
    only_topk = sample(engine, PROMPT, sampling(max_tokens=1), topk=2)
    assert only_topk["prompt_logprobs"] is None and len(only_topk["topk_prompt_logprobs"][1]) == 2
    neither = sample(engine, PROMPT, sampling(max_tokens=1))
    assert neither["prompt_logprobs"] is None and neither["topk_prompt_logprobs"] is None


def _trained_adapter_dir(engine: Engine, tmp_path: Path, model_id: str = "s1", seed: int = 2) -> tuple[Path, torch.Tensor]:
    create(engine, model_id, rank=4, seed=1)
    perturb(engine, model_id, seed=seed, scale=0.2)
    live = fb(engine, model_id, "cross_entropy", [datum(PROMPT[:-1], torch.tensor(PROMPT[1:]))], forward_only=True)
    directory = tmp_path / f"sampler-{model_id}"
    saved = engine.call("save_sampler", {"model_id": model_id, "dir": str(directory)})
    assert saved == {"dir": str(directory), "size_bytes": saved["size_bytes"]} and saved["size_bytes"] > 0
    return directory, out_logprobs(live, 0)


def test_saved_sampler_matches_live_adapter(engine: Engine, tmp_path: Path, tiny_model_dir: Path) -> None:
    directory, live = _trained_adapter_dir(engine, tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = sample(engine, PROMPT, sampling(max_tokens=1), adapter_dir=str(directory), prompt_logprobs=True)
    torch.testing.assert_close(torch.tensor(saved["prompt_logprobs"][1:]), live, rtol=1e-5, atol=1e-5)
    base = sample(engine, PROMPT, sampling(max_tokens=1), prompt_logprobs=True)
    assert (torch.tensor(base["prompt_logprobs"][1:]) - live).abs().max() > 1e-3  # the adapter matters

    # The directory is a standard PEFT adapter: a plain transformers + PEFT load gives the same numbers.
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(fresh, str(directory)).eval()
    assert peft_model.peft_config["default"].base_model_name_or_path == str(tiny_model_dir)
    with torch.no_grad():
        logp = torch.log_softmax(peft_model(input_ids=torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    expected = torch.stack([logp[i - 1, PROMPT[i]] for i in range(1, len(PROMPT))])
    torch.testing.assert_close(expected, live, rtol=1e-5, atol=1e-5)
    keys = safetensors_keys(directory / "adapter_model.safetensors")
    assert keys and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys)  # no base weights


def test_saved_sampler_in_a_fresh_engine(engine: Engine, tmp_path: Path, tiny_model_dir: Path) -> None:
    """An engine that never trained this model (an agent restart) samples the saved version."""
    directory, live = _trained_adapter_dir(engine, tmp_path)
    other = Engine(Placement(torch.device("cpu"), torch.float32))
    other.call("load_base", {"name": "tiny", "path": str(tiny_model_dir)})
    saved = sample(other, PROMPT, sampling(max_tokens=3, seed=4), adapter_dir=str(directory), prompt_logprobs=True)
    torch.testing.assert_close(torch.tensor(saved["prompt_logprobs"][1:]), live, rtol=1e-5, atol=1e-5)
    assert saved == sample(engine, PROMPT, sampling(max_tokens=3, seed=4), adapter_dir=str(directory),
                           prompt_logprobs=True)
    # Training adapters can still be added next to the loaded sampler adapter.
    create(other, "late", seed=1)
    fb(other, "late", "cross_entropy", [datum(PROMPT, torch.tensor(PROMPT))])
    other.call("optim_step", {"model_id": "late", "adam": {"learning_rate": 0.01}})
    again = sample(other, PROMPT, sampling(max_tokens=3, seed=4), adapter_dir=str(directory), prompt_logprobs=True)
    assert again == saved


def test_sampler_adapters_are_cached_and_evicted(engine: Engine, tmp_path: Path) -> None:
    engine.registry.sampler_cache_size = 2
    dirs = [_trained_adapter_dir(engine, tmp_path, f"c{i}", seed=i)[0] for i in range(3)]
    peft_config = engine.registry.base("tiny").peft.peft_config
    outs = [sample(engine, PROMPT, sampling(max_tokens=4, seed=5), adapter_dir=str(d), prompt_logprobs=True) for d in dirs]
    assert len([a for a in peft_config if a.startswith("tb_s_")]) == 2
    again = sample(engine, PROMPT, sampling(max_tokens=4, seed=5), adapter_dir=str(dirs[0]), prompt_logprobs=True)
    assert again == outs[0]  # reloaded after eviction, same result
    assert outs[0]["prompt_logprobs"] != outs[1]["prompt_logprobs"]
    # Sampling never disturbs a training adapter's gradients or trainability.
    model = engine.registry.model("c0")
    fb(engine, "c0", "cross_entropy", [datum(PROMPT, torch.tensor(PROMPT))])
    grads_before = [p.grad.clone() for p in model.parameters()]
    sample(engine, PROMPT, sampling(max_tokens=3), adapter_dir=str(dirs[1]))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads_before, model.parameters()))
    fb(engine, "c0", "cross_entropy", [datum(PROMPT, torch.tensor(PROMPT))])
    assert all(torch.allclose(2 * g, p.grad, rtol=1e-5, atol=1e-6) for g, p in zip(grads_before, model.parameters()))


def test_sampling_params_outside_their_bounds_are_refused(engine: Engine) -> None:
    """The bounds come from protocol.json: the engine checks a request frame's args before it samples."""
    def reply(params: dict[str, Any]) -> dict[str, Any]:
        args = {"base_model": "tiny", "adapter_dir": None, "prompt": PROMPT, "num_samples": 1, "sampling_params": params,
                "prompt_logprobs": False, "topk_prompt_logprobs": 0, "target_prompt_logprobs": None,
                "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0}
        return engine.reply(encode_frame({"id": 1, "op": "sample", "args": args})[4:])

    assert len(reply(sampling(max_tokens=2))["result"]["sequences"][0]["tokens"]) <= 2
    for params, message in [
        (sampling(max_tokens=0), "args.sampling_params.max_tokens: 0 breaks exclusiveMinimum 0"),
        (sampling(top_p=0.0), "args.sampling_params.top_p: 0.0 breaks exclusiveMinimum 0"),
        (sampling(top_p=1.5), "args.sampling_params.top_p: 1.5 breaks maximum 1"),
        (sampling(temperature=-0.5), "args.sampling_params.temperature: -0.5 breaks minimum 0"),
        (sampling(top_k=-2), "args.sampling_params.top_k: -2 breaks minimum -1"),
        (sampling(stop_strings=[""]), "args.sampling_params.stop_strings[0]: must not be empty"),
    ]:
        assert reply(params)["error"] == {"category": "user", "message": f"sample: {message}"}


def test_sample_user_errors(engine: Engine, tmp_path: Path) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    with pytest.raises(UserError, match="outside the vocabulary"):
        sample(engine, PROMPT + [vocab], sampling())
    with pytest.raises(UserError, match="at least one token"):
        sample(engine, [], sampling())
    with pytest.raises(UserError, match="context length"):
        sample(engine, PROMPT, sampling(max_tokens=5000))
    with pytest.raises(UserError, match="not a PEFT adapter directory"):
        sample(engine, PROMPT, sampling(), adapter_dir=str(tmp_path / "missing"))
    with pytest.raises(UserError, match="not loaded"):
        engine.call("sample", {"base_model": "other", "prompt": PROMPT, "num_samples": 1,
                               "sampling_params": sampling()})
