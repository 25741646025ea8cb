"""``sample_batch``: many requests generated together give what each would give alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers import BASE, create, datum, fb, perturb, sample, sampling
from tinker_engine.engine import Engine

PROMPTS = [[12, 400, 7, 88, 301, 5, 977, 64], [3, 19], [700, 701, 702, 703, 50], [9]]


def request(prompt: list[int], params: dict[str, Any], num_samples: int = 1, adapter_dir: str | None = None,
            prompt_logprobs: bool = False, topk: int = 0) -> dict[str, Any]:
    params = {**params, "stop_at_eos": False}  # the tiny model's EOS would end rows at random lengths
    return {"adapter_dir": adapter_dir, "prompt": prompt, "num_samples": num_samples, "sampling_params": params,
            "prompt_logprobs": prompt_logprobs, "topk_prompt_logprobs": topk}


def batch(engine: Engine, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return engine.call("sample_batch", {"base_model": BASE, "requests": requests})["results"]


def full_logp(engine: Engine, tokens: list[int], adapter_dir: str | None = None) -> torch.Tensor:
    """Unbatched, unpadded, cache-free float32 log-softmax at every position."""
    base = engine.registry.base(BASE)
    adapter = engine.registry.sampler_adapter(base, adapter_dir) if adapter_dir else None
    base.activate(adapter)
    with torch.no_grad():
        return torch.log_softmax(base.hf(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def saved_sampler(engine: Engine, tmp_path: Path, model_id: str, seed: int) -> str:
    create(engine, model_id, rank=4, seed=seed)
    perturb(engine, model_id, seed=seed, scale=0.3)
    directory = tmp_path / model_id
    engine.call("save_sampler", {"model_id": model_id, "dir": str(directory)})
    return str(directory)


def test_batch_equals_each_request_alone(engine: Engine) -> None:
    reqs = [
        request(PROMPTS[0], sampling(max_tokens=9, seed=1), num_samples=3),
        request(PROMPTS[1], sampling(max_tokens=4, temperature=0.0)),
        request(PROMPTS[2], sampling(max_tokens=7, temperature=0.8, top_k=20, top_p=0.9, seed=5), num_samples=2),
        request(PROMPTS[3], sampling(max_tokens=12, seed=2)),
    ]
    together = batch(engine, reqs)
    assert all(r["ok"] for r in together)
    for req, got in zip(reqs, together):
        alone = sample(engine, req["prompt"], req["sampling_params"], num_samples=req["num_samples"])
        assert [s["tokens"] for s in got["result"]["sequences"]] == [s["tokens"] for s in alone["sequences"]]
        for a, b in zip(got["result"]["sequences"], alone["sequences"]):
            torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=1e-5, atol=1e-5)
            assert len(a["tokens"]) == req["sampling_params"]["max_tokens"]  # per-request max_tokens
    # The same request in a batch of different companions, and reordered, keeps its tokens.
    other = batch(engine, [reqs[3], request([5, 6, 7, 8, 9, 10, 11], sampling(max_tokens=20, seed=9)), reqs[0]])
    assert other[2]["result"]["sequences"] == together[0]["result"]["sequences"] or \
        [s["tokens"] for s in other[2]["result"]["sequences"]] == [s["tokens"] for s in together[0]["result"]["sequences"]]
    assert [s["tokens"] for s in other[0]["result"]["sequences"]] == \
        [s["tokens"] for s in together[3]["result"]["sequences"]]


def test_left_padded_rows_match_a_cache_free_forward(engine: Engine) -> None:
    """Sampled-token logprobs of short (left-padded) prompts equal an unpadded full forward's."""
    results = batch(engine, [request(p, sampling(max_tokens=6, seed=i)) for i, p in enumerate(PROMPTS)])
    for prompt, res in zip(PROMPTS, results):
        seq = res["result"]["sequences"][0]
        logp = full_logp(engine, prompt + seq["tokens"])
        expected = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq["tokens"])]
        torch.testing.assert_close(torch.tensor(seq["logprobs"]), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_stops_end_rows_independently(engine: Engine) -> None:
    greedy = batch(engine, [request(PROMPTS[0], sampling(max_tokens=10, temperature=0.0))])[0]["result"]
    tokens = greedy["sequences"][0]["tokens"]
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    res = batch(engine, [request(PROMPTS[0], sampling(max_tokens=10, temperature=0.0, stop_tokens=[tokens[stop_at]])),
                         request(PROMPTS[0], sampling(max_tokens=10, temperature=0.0))])
    assert res[0]["result"]["sequences"][0] == {**greedy["sequences"][0], "tokens": tokens[: stop_at + 1],
                                                "logprobs": res[0]["result"]["sequences"][0]["logprobs"],
                                                "stop_reason": "stop"}
    assert res[1]["result"]["sequences"][0]["tokens"] == tokens
    assert res[1]["result"]["sequences"][0]["stop_reason"] == "length"


def test_mixed_adapters_share_a_batch(engine: Engine, tmp_path: Path) -> None:
    a = saved_sampler(engine, tmp_path, "ma", seed=3)
    b = saved_sampler(engine, tmp_path, "mb", seed=4)
    reqs = [request(PROMPTS[0], sampling(max_tokens=5, seed=1), adapter_dir=a, prompt_logprobs=True),
            request(PROMPTS[2], sampling(max_tokens=5, seed=2), adapter_dir=b),
            request(PROMPTS[1], sampling(max_tokens=5, seed=3))]
    results = batch(engine, reqs)
    for req, res in zip(reqs, results):
        assert res["ok"], res
        seq = res["result"]["sequences"][0]
        logp = full_logp(engine, req["prompt"] + seq["tokens"], req["adapter_dir"])
        expected = [float(logp[len(req["prompt"]) - 1 + i, t]) for i, t in enumerate(seq["tokens"])]
        torch.testing.assert_close(torch.tensor(seq["logprobs"]), torch.tensor(expected), rtol=1e-5, atol=1e-5)
        alone = sample(engine, req["prompt"], req["sampling_params"], adapter_dir=req["adapter_dir"],
                       prompt_logprobs=req["prompt_logprobs"])
        assert [s["tokens"] for s in alone["sequences"]] == [seq["tokens"]]
    plp = full_logp(engine, PROMPTS[0], a)
    expected = [float(plp[i - 1, PROMPTS[0][i]]) for i in range(1, len(PROMPTS[0]))]
    torch.testing.assert_close(torch.tensor(results[0]["result"]["prompt_logprobs"][1:]), torch.tensor(expected),
                               rtol=1e-5, atol=1e-5)
    # Sampling left the training adapters trainable.
    fb(engine, "ma", "cross_entropy", [datum(PROMPTS[0], torch.tensor(PROMPTS[0]))])
    assert all(p.grad is not None for p in engine.registry.model("ma").parameters())


def test_a_bad_request_fails_alone(engine: Engine, tmp_path: Path) -> None:
    vocab = engine.registry.base(BASE).vocab_size
    results = batch(engine, [
        request(PROMPTS[0], sampling(max_tokens=3, seed=1)),
        request(PROMPTS[1] + [vocab], sampling()),
        request(PROMPTS[2], sampling(max_tokens=3, seed=1), adapter_dir=str(tmp_path / "missing")),
        request(PROMPTS[1], sampling(max_tokens=5000)),
        "not a request",
    ])
    assert results[0]["ok"] and len(results[0]["result"]["sequences"][0]["tokens"]) == 3
    messages = ["outside the vocabulary", "not a PEFT adapter directory", "context length", "must be an object"]
    for res, message in zip(results[1:], messages):
        assert res["ok"] is False and res["error"]["category"] == "user" and message in res["error"]["message"]


def _drive(engine: Engine, *steps: Any) -> list[Any]:
    """Advance the engine until every stepped op is done; their results in order."""
    results: list[Any] = [None] * len(steps)
    live = dict(enumerate(steps))
    while live:
        for i, s in list(live.items()):
            try:
                next(s)
            except StopIteration as done:
                results[i] = done.value
                del live[i]
        engine.advance()
    return results


def test_requests_join_a_generating_batch(engine: Engine) -> None:
    first = engine.sampler.sample_batch_steps({"base_model": BASE, "requests": [
        request(PROMPTS[1], sampling(max_tokens=16, seed=1), num_samples=2)]})
    next(first)
    for _ in range(5):
        engine.advance()  # the first request is 4-5 tokens in
    late = [request(PROMPTS[0], sampling(max_tokens=6, seed=2)),
            request(PROMPTS[2], sampling(max_tokens=9, temperature=0.0), prompt_logprobs=True)]
    second = engine.sampler.sample_batch_steps({"base_model": BASE, "requests": late})
    gen = engine.sampler.generations["tiny"]
    (a,), (b, c) = [r["results"] for r in _drive(engine, first, second)]
    assert not gen.busy
    for req, res in ((request(PROMPTS[1], sampling(max_tokens=16, seed=1), num_samples=2), a), (late[0], b), (late[1], c)):
        assert res["ok"], res
        alone = sample(engine, req["prompt"], req["sampling_params"], num_samples=req["num_samples"])
        assert [s["tokens"] for s in res["result"]["sequences"]] == [s["tokens"] for s in alone["sequences"]]
        for seq in res["result"]["sequences"]:
            logp = full_logp(engine, req["prompt"] + seq["tokens"])
            expected = [float(logp[len(req["prompt"]) - 1 + i, t]) for i, t in enumerate(seq["tokens"])]
            torch.testing.assert_close(torch.tensor(seq["logprobs"]), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert c["result"]["prompt_logprobs"][0] is None and len(c["result"]["prompt_logprobs"]) == len(PROMPTS[2])


def test_token_budget_holds_requests_back(engine: Engine) -> None:
    engine.sampler.max_tokens = 40  # one request of 2 x (2 + 16) fits, a second does not
    first = engine.sampler.sample_batch_steps({"base_model": BASE, "requests": [
        request(PROMPTS[1], sampling(max_tokens=16, seed=1), num_samples=2)]})
    next(first)
    engine.advance()
    second = engine.sampler.sample_batch_steps({"base_model": BASE, "requests": [
        request(PROMPTS[1], sampling(max_tokens=16, seed=1), num_samples=2)]})
    next(second)
    engine.advance()
    gen = engine.sampler.generations["tiny"]
    assert len(gen.row_seq) == 2 and len(gen.waiting) == 1
    a, b = _drive(engine, first, second)
    assert a == b  # same seed, same tokens, whenever it ran
