"""The verl engine's translation (tinker_engine_verl.translate) on CPU, without verl.

Synthetic inputs, checked against the torch engine on the tiny model: verl's FSDP engine scores
row position t with log p(input_ids[t+1] | input_ids[:t+1]) (it rolls the packed ids by -1); this
test computes exactly that from the same model and checks that our translation and loss give the
torch engine's loss, per-token logprobs and gradients; the loss and logprobs over TensorDict
micro-batches as verl's engine passes them (tensordict, without verl). Fixtures recorded from the
real engine on the H200 (test/fixtures/verl/*.json, written by bench/gpu/verl_check.sh) are
replayed at the end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import create, datum, fb, grads, out_logprobs, perturb, zero_grads
from tinker_engine.errors import UserError
from tinker_engine.losses import LOSSES, get_loss
from tinker_engine.train import parse_datum
from tinker_engine_verl import translate

FIXTURES = Path(__file__).resolve().parents[3] / "test" / "fixtures" / "verl"


def parsed(engine: Any, loss_fn: str, data: list[dict[str, Any]], config: dict[str, Any] | None = None) -> list[Any]:
    base = engine.registry.base("tiny")
    spec = get_loss(loss_fn)
    return [parse_datum(i, d, base, spec, spec.parse_config(config or {})) for i, d in enumerate(data)]


def next_token_datum(seq: list[int], **inputs: torch.Tensor) -> dict[str, Any]:
    """A datum whose targets are its next tokens: tokens seq[:-1], targets seq[1:]."""
    return datum(seq[:-1], torch.tensor(seq[1:]), **inputs)


def verl_style_logprobs(engine: Any, model_id: str, fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """What verl's FSDP engine computes for ``fields`` (NO_PADDING, no remove-padding): per row the
    model's log-softmax at every position, gathered at the packed ids rolled by -1; jagged."""
    model = engine.registry.model(model_id)
    model.base.activate(model.adapter, trainable=True)
    ids = fields["input_ids"]
    rolled = torch.roll(ids.values(), shifts=-1, dims=0)
    off = ids.offsets().tolist()
    rows = []
    for b in range(len(off) - 1):
        row_ids = ids.values()[off[b]:off[b + 1]].unsqueeze(0)
        logits = model.base.hf(input_ids=row_ids, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        rows.append(logp.gather(-1, rolled[off[b]:off[b + 1]].unsqueeze(-1)).squeeze(-1))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


# --- pure translation --------------------------------------------------------------------------


def test_shard_rows_gives_every_rank_the_same_nonzero_count() -> None:
    assert translate.shard_rows(5, 1, 0) == [0, 1, 2, 3, 4]
    assert translate.shard_rows(5, 2, 0) == [0, 2, 4]
    assert translate.shard_rows(5, 2, 1) == [1, 3, None]
    assert translate.shard_rows(1, 4, 3) == [None]
    assert translate.shard_rows(1, 4, 0) == [0]
    covered = sorted(r for rank in range(3) for r in translate.shard_rows(7, 3, rank) if r is not None)
    assert covered == list(range(7))
    with pytest.raises(UserError):
        translate.shard_rows(0, 1, 0)


def test_targets_must_be_next_tokens(engine: Any) -> None:
    ok = parsed(engine, "cross_entropy", [next_token_datum([5, 6, 7, 8])])[0]
    translate.check_next_token_targets(ok)
    single = parsed(engine, "cross_entropy", [datum([9], torch.tensor([3]))])[0]
    translate.check_next_token_targets(single)  # one token: any target is its next token
    bad = parsed(engine, "cross_entropy", [datum([5, 6, 7], torch.tensor([6, 9, 8]))])[0]
    with pytest.raises(UserError, match=r"position 1 has target 9 but the next token is 7"):
        translate.check_next_token_targets(bad)
    topk = parsed(engine, "cross_entropy", [datum([5, 6], torch.tensor([[6, 1], [7, 2]]))])[0]
    with pytest.raises(UserError, match="top-K"):
        translate.check_next_token_targets(topk)


def test_build_fields_layout(engine: Any) -> None:
    data = [next_token_datum([1, 2, 3, 4], weights=torch.tensor([1.0, 0.5, 0.0])),
            next_token_datum([7, 8], weights=torch.tensor([2.0]))]
    datums = parsed(engine, "cross_entropy", data)
    fields = translate.build_fields(datums, [1, 0, None], ["weights"])
    assert fields["input_ids"].offsets().tolist() == [0, 2, 6, 10]
    assert fields["input_ids"].values().tolist() == [7, 8, 1, 2, 3, 4, 1, 2, 3, 4]
    assert fields["position_ids"].values().tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 2, 3]
    assert fields["loss_mask"].values().tolist() == [1, 0, 1, 1, 1, 0, 1, 1, 1, 0]
    assert fields["tb_weights"].values().tolist() == [2.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0]
    assert fields[translate.SCALE_KEY].tolist() == [1.0, 1.0, 0.0]
    assert fields[translate.INDEX_KEY].tolist() == [1, 0, -1]
    meta = translate.non_tensor_fields(fields, 4)
    assert meta["global_token_num"] == [2, 4, 4]
    assert meta["max_token_len_per_gpu"] == 4 and meta["temperature"] == 1.0
    assert meta["use_remove_padding"] is False and meta["use_dynamic_bsz"] is True


def test_missing_weights_are_ones_when_another_datum_has_them(engine: Any) -> None:
    data = [next_token_datum([1, 2, 3]), next_token_datum([4, 5, 6], weights=torch.tensor([3.0, 4.0]))]
    datums = parsed(engine, "cross_entropy", data)
    names = translate.input_names_for(get_loss("cross_entropy"), datums)
    assert names == ["weights"]
    fields = translate.build_fields(datums, [0, 1], names)
    assert fields["tb_weights"].values().tolist() == [1.0, 1.0, 0.0, 3.0, 4.0, 0.0]
    assert translate.input_names_for(get_loss("cross_entropy"), datums[:1]) == []
    assert translate.input_names_for(get_loss("ppo"), datums) == ["logprobs", "advantages"]


def test_describe_round_trip(engine: Any) -> None:
    datums = parsed(engine, "cross_entropy", [next_token_datum([1, 2, 3, 4]), next_token_datum([5, 6])])
    fields = translate.build_fields(datums, [0, 1], [])
    desc = json.loads(json.dumps(translate.describe_fields({**fields, "dp_size": 1})))
    back = translate.jagged_from_description(desc["input_ids"])
    assert back.values().tolist() == fields["input_ids"].values().tolist()
    assert back.offsets().tolist() == fields["input_ids"].offsets().tolist()
    assert desc["tb_scale"] == {"layout": "strided", "dtype": "float32", "shape": [2], "values": [1.0, 1.0]}
    assert desc["dp_size"] == {"layout": "non_tensor", "value": 1}


# --- the loss over verl-style logprobs equals the torch engine's -------------------------------


def rl_inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"logprobs": -torch.rand(n, generator=gen) * 3 - 2.0, "advantages": torch.randn(n, generator=gen)}


def stability_inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    """What the API attaches for stable_reinforce: the recorded sampler logprobs at sampled positions."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(n) >= n // 3).float()
    return {"advantages": torch.randn(n, generator=gen) * mask,
            "stability_logprobs": (-torch.rand(n, generator=gen) * 3 - 2.0) * mask, "stability_mask": mask}


CASES = {
    "cross_entropy": ({}, lambda n, s: {"weights": torch.rand(n, generator=torch.Generator().manual_seed(s)) * 2 - 0.5}),
    "importance_sampling": ({}, rl_inputs),
    "ppo": ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, rl_inputs),
    "cispo": ({}, rl_inputs),
    "dro": ({"beta": 0.3}, rl_inputs),
    "gspo": ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, rl_inputs),
    "stable_reinforce": ({"kl_coeff": 0.1}, stability_inputs),
}


def test_cases_cover_every_loss() -> None:
    assert set(CASES) == set(LOSSES)


@pytest.mark.parametrize("loss_fn", sorted(CASES))
def test_loss_logprobs_and_grads_match_the_torch_engine(engine: Any, loss_fn: str) -> None:
    config, make_inputs = CASES[loss_fn]
    create(engine, "m", rank=4, seed=3)
    perturb(engine, "m", seed=5)
    seqs = [[3, 17, 42, 8, 99, 5], [11, 12], [60, 61, 62, 63]]
    data = [next_token_datum(s, **make_inputs(len(s) - 1, i)) for i, s in enumerate(seqs)]

    ref = fb(engine, "m", loss_fn, data, config)
    ref_grads = grads(engine, "m")
    zero_grads(engine, "m")

    spec = get_loss(loss_fn)
    parsed_config = spec.parse_config(config)
    datums = parsed(engine, loss_fn, data, config)
    names = translate.input_names_for(spec, datums)
    # Two data-parallel "ranks" of one process each: rank 1 gets a padding row; each rank's loss is
    # scaled by dp_size (verl's FSDP averages gradients over ranks), so the summed backward / 2 is
    # the gradient of the sum over datums.
    world = 2
    total = 0.0
    outputs: dict[int, torch.Tensor] = {}
    loss_fn_verl = translate.make_loss_fn(spec, parsed_config, names)
    for rank in range(world):
        rows = translate.shard_rows(len(datums), world, rank)
        fields = translate.build_fields(datums, rows, names)
        log_probs = verl_style_logprobs(engine, "m", fields)
        loss, metrics = loss_fn_verl({"log_probs": log_probs}, {**fields, "dp_size": world})
        assert metrics == {}
        (loss / world).backward()
        total += float(loss.detach()) / world
        for r, lp in zip(rows, translate.row_logprobs(log_probs, fields)):
            if r is not None:
                outputs[r] = lp

    assert total == pytest.approx(ref["metrics"]["loss:sum"], rel=1e-5, abs=1e-5)
    for i in range(len(data)):
        assert torch.allclose(outputs[i], out_logprobs(ref, i), atol=1e-5), i
    got = grads(engine, "m")
    for name, g in ref_grads.items():
        assert g is not None and got[name] is not None
        assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-6), name


def test_padding_rows_contribute_nothing(engine: Any) -> None:
    create(engine, "m", rank=4, seed=3)
    perturb(engine, "m", seed=5)
    datums = parsed(engine, "cross_entropy", [next_token_datum([4, 5, 6, 7])])
    spec = get_loss("cross_entropy")
    fields_one = translate.build_fields(datums, [0], [])
    fields_pad = translate.build_fields(datums, [0, None, None], [])
    fn = translate.make_loss_fn(spec, {}, [])
    one, _ = fn({"log_probs": verl_style_logprobs(engine, "m", fields_one)}, fields_one)
    padded, _ = fn({"log_probs": verl_style_logprobs(engine, "m", fields_pad)}, fields_pad)
    assert float(padded.detach()) == pytest.approx(float(one.detach()), rel=1e-6)
    assert float(one.detach()) > 0


def test_row_length_mismatch_is_an_error(engine: Any) -> None:
    datums = parsed(engine, "cross_entropy", [next_token_datum([4, 5, 6])])
    fields = translate.build_fields(datums, [0], [])
    short = torch.nested.as_nested_tensor([torch.zeros(2)], layout=torch.jagged)
    with pytest.raises(RuntimeError, match="returned 2 logprobs for a row of 3 ids"):
        translate.row_losses(get_loss("cross_entropy"), {}, short, fields, [])


# --- TensorDict micro-batches, as verl's engine hands them to the loss ---------------------------


def micro_batches(fields: dict[str, torch.Tensor], budget: int, dp_size: int) -> tuple[list[Any], list[int]]:
    """``fields``' rows regrouped in another order, as verl's dynamic batching may: longest first,
    in TensorDicts of at most ``budget`` ids each (a longer row alone), each with ``dp_size`` as
    non-tensor data (as the engine's ``tu.get_tensordict`` stores it); and the rows' order across
    them. tensordict is the version verl 0.9 requires (test/e2e/requirements.txt)."""
    from tensordict import NonTensorData, TensorDict

    lengths = fields["input_ids"].offsets().diff().tolist()
    groups: list[list[int]] = []
    used = budget
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if used + lengths[i] > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += lengths[i]
    batches = []
    for rows in groups:
        part = {key: torch.nested.as_nested_tensor([value.unbind()[i] for i in rows], layout=torch.jagged)
                if value.is_nested else value[rows] for key, value in fields.items()}
        td = TensorDict(part, batch_size=[len(rows)])
        td["dp_size"] = NonTensorData(dp_size)
        batches.append(td)
    return batches, [i for rows in groups for i in rows]


def test_loss_and_logprobs_over_tensordict_micro_batches(engine: Any) -> None:
    seqs = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16]]
    data = [next_token_datum(s, weights=torch.full((len(s) - 1,), float(i + 1))) for i, s in enumerate(seqs)]
    datums = parsed(engine, "cross_entropy", data)
    spec = get_loss("cross_entropy")
    names = translate.input_names_for(spec, datums)
    fields = translate.build_fields(datums, list(range(len(datums))), names)
    micro, order = micro_batches(fields, 8, dp_size=2)
    assert len(micro) > 1 and order != sorted(order)  # the 8-id budget splits and reorders the batch
    fn = translate.make_loss_fn(spec, {}, names)
    total, rows_out = 0.0, []
    for mb in micro:
        # a stand-in for verl's log_probs: -(position + 1) / 10 on every row
        lp = torch.nested.as_nested_tensor(
            [-(torch.arange(len(r), dtype=torch.float32) + 1) / 10 for r in mb["input_ids"].unbind()],
            layout=torch.jagged)
        loss, _ = fn({"log_probs": lp}, mb)
        total += float(loss)
        rows_out += list(lp.unbind())
    # back in the batch's row order, as verl returns log_probs
    restored: list[torch.Tensor] = [torch.empty(0)] * len(order)
    for pos, i in enumerate(order):
        restored[i] = rows_out[pos]
    rows = translate.row_logprobs(torch.nested.as_nested_tensor(restored, layout=torch.jagged), fields)
    # each rank's loss is its sum times dp_size (2, read from the TensorDict's non-tensor data)
    expected = 2 * sum(float(i + 1) * sum((k + 1) / 10 for k in range(len(s) - 1)) for i, s in enumerate(seqs))
    assert total == pytest.approx(expected, rel=1e-6)
    for s, lp in zip(seqs, rows):
        assert lp.tolist() == pytest.approx([-(k + 1) / 10 for k in range(len(s) - 1)])


# --- fixtures recorded from the real verl engine on the H200 -------------------------------------


def recorded_fixtures() -> list[tuple[str, dict[str, Any]]]:
    """(id, fixture) of every recorded forward_backward: ``*.json`` files holding one fixture, or a
    bundle ``{"format": 1, "fixtures": [...]}`` as bench/gpu/verl_check.py writes (verl_fixtures.json)."""
    found: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []:
        obj = json.loads(path.read_text())
        for i, fx in enumerate(obj["fixtures"] if "fixtures" in obj else [obj]):
            found.append((f"{path.name}:{fx.get('name', i)}", fx))
    return found


def test_fixtures_are_recorded() -> None:
    """The replays below need them: test/fixtures/verl/ is part of the repository."""
    assert recorded_fixtures(), f"no fixtures in {FIXTURES}"


@pytest.mark.parametrize("fx", [fx for _, fx in recorded_fixtures()], ids=[i for i, _ in recorded_fixtures()])
def test_recorded_fixture_replays(fx: dict[str, Any]) -> None:
    replay(fx)


def replay(fx: dict[str, Any]) -> None:
    """Rebuild the batch from the recorded request and compare it with what the engine sent verl;
    recompute the per-datum logprobs and the loss from verl's recorded log_probs."""
    req = fx["request"]
    spec = get_loss(req["loss_fn"])
    config = spec.parse_config(req.get("loss_fn_config"))

    class Base:  # parse_datum's bounds; the recorded ids were valid for the run's model
        max_context_length = 0
        vocab_size = input_vocab_size = 1 << 40

    datums = [parse_datum(i, d, Base(), spec, config) for i, d in enumerate(req["data"])]
    names = translate.input_names_for(spec, datums)
    rows = [None if i < 0 else i for i in fx["fields"][translate.INDEX_KEY]["values"]]
    fields = translate.build_fields(datums, rows, names)
    assert translate.describe_fields(fields) == fx["fields"]
    assert translate.non_tensor_fields(fields, fx["non_tensor"]["max_token_len_per_gpu"]) == fx["non_tensor"]
    log_probs = translate.jagged_from_description(fx["verl_log_probs"])
    got = translate.row_logprobs(log_probs, fields)
    mine = {r: lp.tolist() for r, lp in zip(rows, got) if r is not None}
    if fx["world_size"] == 1:
        assert [mine[i] for i in range(len(datums))] == fx["result"]["logprobs"]
        loss, _ = translate.make_loss_fn(spec, config, names)({"log_probs": log_probs}, {**fields, "dp_size": 1})
        # the engine's loss came from these float32 logprobs, summed per micro-batch in another order
        assert math.isclose(float(loss), fx["result"]["loss:sum"], rel_tol=1e-5, abs_tol=1e-4)


def test_record_and_replay_round_trip(engine: Any, tmp_path: Path) -> None:
    """The recorder the engine runs on the GPU (settings ``record``, TB_VERL_RECORD) writes what replay() reads back."""
    from tinker_engine_verl import settings as verl_settings
    from tinker_engine_verl.engine import VerlEngine

    create(engine, "m", rank=4, seed=3)
    perturb(engine, "m", seed=5)
    data = [next_token_datum([3, 17, 42, 8, 99], **rl_inputs(4, 0)), next_token_datum([5, 6, 7], **rl_inputs(2, 1))]
    request = {"loss_fn": "ppo", "loss_fn_config": {}, "forward_only": True, "data": data}
    spec = get_loss("ppo")
    datums = parsed(engine, "ppo", data)
    names = translate.input_names_for(spec, datums)
    fields = translate.build_fields(datums, [0, 1], names)
    meta = translate.non_tensor_fields(fields, 16)
    log_probs = verl_style_logprobs(engine, "m", fields)
    outputs = translate.row_logprobs(log_probs, fields)
    loss, _ = translate.make_loss_fn(spec, spec.parse_config({}), names)({"log_probs": log_probs}, fields)
    with verl_settings.overridden(record=str(tmp_path)):
        VerlEngine()._record(request, fields, meta, log_probs, outputs, float(loss))
    (path,) = tmp_path.glob("fb_*.json")
    fx = json.loads(path.read_text())
    replay(fx)
    assert fx["verl_log_probs"]["offsets"] == [0, 5, 8]
    fx["fields"]["input_ids"]["values"][0] += 1  # a changed translation is caught
    with pytest.raises(AssertionError):
        replay(fx)
