"""Continuous snapshots: captured at once, written by the writer thread in save_state's format,
unchanged by the steps that follow the capture, rotated, and never left half-written."""

from __future__ import annotations

import os

import torch

from helpers import adam, create, datum, fb, params, perturb
from tinker_engine.engine import Engine
from tinker_engine.snapshot import SnapshotWriter, complete_snapshots, snapshot_dir, snapshot_state


def _d(vocab: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (6,), generator=gen).tolist()
    return [datum(tokens, torch.tensor(tokens[1:] + [0]))]


def _step(engine: Engine, m: str, vocab: int, seed: int) -> float:
    loss = fb(engine, m, "cross_entropy", _d(vocab, seed))["metrics"]["loss:sum"]
    engine.call("optim_step", {"model_id": m, "adam": adam()})
    return loss


def test_snapshot_holds_the_state_at_capture_and_resumes_exactly(engine: Engine, tmp_path) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    create(engine, "a", seed=4)
    perturb(engine, "a")
    for seed in (1, 2):
        _step(engine, "a", vocab, seed)
    at_capture = [v.clone() for v in params(engine, "a").values()]
    writer = SnapshotWriter()
    root = str(tmp_path / "snap" / "a")
    r = snapshot_state(engine.registry, writer, {"model_id": "a", "root": root, "seq_id": 4, "keep": 2})
    assert r["dir"] == snapshot_dir(root, 4) and r["captured_bytes"] > 0
    # The model trains on while the writer works; the snapshot is the state at capture.
    later = [_step(engine, "a", vocab, seed) for seed in (3, 4)]
    writer.wait(r["dir"])
    assert writer.status(root) == {"last_written": r["dir"], "last_error": None}
    assert sorted(os.listdir(r["dir"])) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "optimizer.json", "optimizer.safetensors", "tinker_state.json"])
    create(engine, "b", seed=9)
    engine.call("load_state", {"model_id": "b", "dir": r["dir"], "optimizer": True})
    assert all(torch.equal(x, y) for x, y in zip(at_capture, params(engine, "b").values(), strict=True))
    # Weights and AdamW moments both came back: the same steps give the same losses, bit for bit.
    assert [_step(engine, "b", vocab, seed) for seed in (3, 4)] == later
    assert all(torch.equal(x, y) for x, y in zip(params(engine, "a").values(), params(engine, "b").values()))


def test_snapshots_rotate_and_leave_no_temporary_directory(engine: Engine, tmp_path) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    create(engine, "r", seed=1)
    root = str(tmp_path / "r")
    os.makedirs(os.path.join(root, f"{snapshot_dir(root, 0)}.tmp-dead00"))  # a crash's leftover
    writer = SnapshotWriter()
    for seq in range(1, 6):
        _step(engine, "r", vocab, seq)
        last = snapshot_state(engine.registry, writer, {"model_id": "r", "root": root, "seq_id": seq * 2, "keep": 2, "wait": True})
    assert complete_snapshots(root) == [snapshot_dir(root, 8), snapshot_dir(root, 10)]
    assert sorted(os.listdir(root)) == [os.path.basename(snapshot_dir(root, 8)), os.path.basename(snapshot_dir(root, 10))]
    assert last["last_written"] == snapshot_dir(root, 10)


def test_a_failed_write_is_reported_and_the_next_one_succeeds(engine: Engine, tmp_path) -> None:
    create(engine, "f", seed=1)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = SnapshotWriter()
    bad = snapshot_state(engine.registry, writer, {"model_id": "f", "root": str(blocker / "f"), "seq_id": 1, "keep": 1, "wait": True})
    assert bad["last_written"] is None and "000000000001" in bad["last_error"]
    root = str(tmp_path / "f")
    good = snapshot_state(engine.registry, writer, {"model_id": "f", "root": root, "seq_id": 2, "keep": 1, "wait": True})
    assert good["last_written"] == snapshot_dir(root, 2) and good["last_error"] is None


def test_the_engine_op_checks_its_frame_and_writes(engine: Engine, tmp_path) -> None:
    create(engine, "o", seed=1)
    root = str(tmp_path / "o")
    r = engine.call("snapshot_state", {"model_id": "o", "root": root, "seq_id": 3, "keep": 1, "wait": True})
    assert r["last_written"] == snapshot_dir(root, 3) and complete_snapshots(root) == [snapshot_dir(root, 3)]
