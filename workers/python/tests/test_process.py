"""End to end: the real ``python -m tinker_engine`` process, spoken to through its framing."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import adam, lora, sampling
from tinker_engine.channel import Channel, encode_frame

PY_ROOT = Path(__file__).resolve().parents[1]


class EngineProcess:
    def __init__(self) -> None:
        path = os.pathsep.join(p for p in (str(PY_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "TB_ENGINE_DEVICE": "cpu"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tinker_engine"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.next_id = 100

    def send_raw(self, body: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(body)) + body)
        self.proc.stdin.flush()

    def read_reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        header = self.proc.stdout.read(4)
        assert len(header) == 4, "engine closed stdout"
        (n,) = struct.unpack(">I", header)
        return json.loads(self.proc.stdout.read(n).decode("utf-8"))

    def request(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        self.send_raw(json.dumps({"id": self.next_id, "op": op, "args": args}).encode())
        reply = self.read_reply()
        assert reply["id"] == self.next_id
        return reply


def test_engine_process_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    eng = EngineProcess()
    try:
        hello = eng.request("hello", {})
        assert hello == {"id": hello["id"], "ok": True,
                         "result": {"protocol": 1, "engine": "torch", "device": "cpu",
                                    "torch": hello["result"]["torch"]}}
        base = eng.request("load_base", {"name": "tiny", "path": str(tiny_model_dir)})["result"]
        assert base["vocab_size"] == 1029 and base["arch"] == "Qwen3ForCausalLM"
        assert base["max_context_length"] == 2048 and base["eos_token_id"] == 1026
        assert eng.request("load_base", {"name": "tiny", "path": str(tiny_model_dir)})["result"] == base
        created = eng.request("create_model", {"model_id": "e2e", "base_model": "tiny", "lora": lora(8)})
        assert created["result"] == {"model_id": "e2e", "lora_rank": 8}

        tokens = [5, 17, 300, 42, 9]
        data = [{"tokens": tokens, "loss_fn_inputs": {
            "target_tokens": {"dtype": "int64", "shape": [5], "data": tokens[1:] + [1]},
            "weights": {"dtype": "float32", "shape": [5], "data": [0.0, 1.0, 1.0, 1.0, 1.0]}}}]
        fb_args = {"model_id": "e2e", "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False,
                   "data": data}
        losses = []
        for _ in range(3):
            fwd = eng.request("forward_backward", fb_args)
            assert fwd["ok"], fwd
            out = fwd["result"]["loss_fn_outputs"][0]["logprobs"]
            assert out["dtype"] == "float32" and out["shape"] == [5]
            losses.append(fwd["result"]["metrics"]["loss:sum"])
            step = eng.request("optim_step", {"model_id": "e2e", "adam": adam(lr=0.05)})
            assert step["ok"] and step["result"]["metrics"]["grad_norm"] > 0
        assert losses[2] < losses[0]  # training on one datum lowers its loss

        # Checkpoint round trip: another model_id resumes from e2e's weights and Adam state.
        state_dir = tmp_path / "state"
        saved = eng.request("save_state", {"model_id": "e2e", "dir": str(state_dir), "optimizer": True})
        assert saved["ok"], saved
        assert saved["result"] == {"dir": str(state_dir),
                                   "size_bytes": sum(p.stat().st_size for p in state_dir.iterdir())}
        again_saved = eng.request("save_state", {"model_id": "e2e", "dir": str(state_dir), "optimizer": True})
        assert again_saved["ok"] is False and again_saved["error"]["category"] == "user"
        assert eng.request("create_model", {"model_id": "e2e-resumed", "base_model": "tiny",
                                            "lora": lora(8, seed=5)})["ok"]
        loaded = eng.request("load_state", {"model_id": "e2e-resumed", "dir": str(state_dir), "optimizer": True})
        assert loaded["result"] == {"model_id": "e2e-resumed", "has_optimizer": True}
        resumed_losses = []
        for model_id in ("e2e", "e2e-resumed", "e2e", "e2e-resumed"):
            fwd = eng.request("forward_backward", {**fb_args, "model_id": model_id})
            resumed_losses.append(fwd["result"]["metrics"]["loss:sum"])
            assert eng.request("optim_step", {"model_id": model_id, "adam": adam(lr=0.05)})["ok"]
        assert abs(resumed_losses[0] - resumed_losses[1]) <= 1e-6
        assert abs(resumed_losses[2] - resumed_losses[3]) <= 1e-6
        assert eng.request("unload_model", {"model_id": "e2e-resumed"})["ok"]

        sampler_dir = tmp_path / "sampler"
        assert eng.request("save_sampler", {"model_id": "e2e", "dir": str(sampler_dir)})["ok"]
        sample_args = {"base_model": "tiny", "adapter_dir": str(sampler_dir), "prompt": tokens, "num_samples": 2,
                       "sampling_params": sampling(max_tokens=4, seed=9), "prompt_logprobs": True,
                       "topk_prompt_logprobs": 2}
        sampled = eng.request("sample", sample_args)
        assert sampled["ok"], sampled
        assert [len(s["tokens"]) for s in sampled["result"]["sequences"]] == [4, 4]
        assert sampled["result"]["prompt_logprobs"][0] is None

        unknown = eng.request("explode", {})
        assert unknown["ok"] is False and unknown["error"]["category"] == "server"
        assert "unknown op 'explode'" in unknown["error"]["message"]

        bad = eng.request("forward_backward", {**fb_args, "data": [{**data[0], "tokens": [5, 17, 300, 42, 99999]}]})
        assert bad["ok"] is False and bad["error"]["category"] == "user"
        assert "outside the vocabulary" in bad["error"]["message"]

        eng.send_raw(b"{not json")
        garbled = eng.read_reply()
        assert garbled["id"] is None and garbled["ok"] is False and garbled["error"]["category"] == "server"

        again = eng.request("sample", sample_args)  # still serving, and the same seed gives the same tokens
        assert again["ok"] and again["result"] == sampled["result"]
        assert eng.request("unload_model", {"model_id": "e2e"})["result"] == {"model_id": "e2e"}
    finally:
        assert eng.proc.stdin is not None
        eng.proc.stdin.close()
        rc = eng.proc.wait(timeout=30)
        stderr = eng.proc.stderr.read().decode() if eng.proc.stderr else ""
        leftover = eng.proc.stdout.read() if eng.proc.stdout else b""
    assert rc == 0
    assert leftover == b""  # nothing but reply frames on stdout
    assert "op=forward_backward model_id=e2e" in stderr
    assert "op=explode" in stderr and "server_error" in stderr


def test_channel_framing_round_trip() -> None:
    reader = io.BytesIO(encode_frame({"id": 1, "op": "hello"}) + encode_frame({"id": 2}) + b"\x00\x00")
    writer = io.BytesIO()
    ch = Channel(reader, writer)
    assert json.loads(ch.read()) == {"id": 1, "op": "hello"}
    assert json.loads(ch.read()) == {"id": 2}
    assert ch.read() is None  # a truncated header is a closed channel
    ch.write({"id": 3, "ok": True, "result": {"x": float("nan"), "y": [1.5, float("inf")]}})
    raw = writer.getvalue()
    assert struct.unpack(">I", raw[:4])[0] == len(raw) - 4
    assert json.loads(raw[4:]) == {"id": 3, "ok": True, "result": {"x": None, "y": [1.5, None]}}


@pytest.mark.parametrize("payload", [b"[]", b'{"id": "x", "op": "hello"}', b'{"id": 1, "op": "hello", "args": 3}'])
def test_malformed_requests_get_error_replies(payload: bytes) -> None:
    from tinker_engine.device import Placement
    from tinker_engine.engine import Engine
    import torch

    reply = Engine(Placement(torch.device("cpu"), torch.float32)).reply(payload)
    assert reply["ok"] is False and reply["error"]["category"] == "server"


def test_training_op_does_not_wait_for_a_long_sample_batch(tiny_model_dir: Path) -> None:
    """A forward_backward sent while a long sample batch generates is answered between decode steps.

    Structural, not timed (two shared cores make wall times noisy): the training reply comes first,
    while the batch still has most of its 8 x 2000 tokens to go; the wait is one decode step plus
    the op itself (bench: docs/benchmarks.md).
    """
    import time

    eng = EngineProcess()
    try:
        assert eng.request("load_base", {"name": "tiny", "path": str(tiny_model_dir)})["ok"]
        assert eng.request("create_model", {"model_id": "m", "base_model": "tiny", "lora": lora(4)})["ok"]
        long_sample = {"base_model": "tiny", "requests": [
            {"prompt": [5, 17, 300], "num_samples": 8,
             "sampling_params": {**sampling(max_tokens=2000, seed=1), "stop_at_eos": False}}]}
        eng.send_raw(json.dumps({"id": 1, "op": "sample_batch", "args": long_sample}).encode())
        time.sleep(0.5)  # the batch is decoding
        tokens = [5, 17, 300, 42]
        fb_args = {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False,
                   "data": [{"tokens": tokens, "loss_fn_inputs": {
                       "target_tokens": {"dtype": "int64", "shape": [4], "data": tokens[1:] + [1]}}}]}
        sent = time.perf_counter()
        eng.send_raw(json.dumps({"id": 2, "op": "forward_backward", "args": fb_args}).encode())
        first = eng.read_reply()
        waited = time.perf_counter() - sent
        assert first["id"] == 2 and first["ok"], first
        print(f"forward_backward answered {waited:.2f} s after it was sent, during the sample batch")
        # Still serving in order: a hello now is answered while the batch keeps going.
        assert eng.request("hello", {})["ok"]
    finally:
        assert eng.proc.stdin is not None
        eng.proc.stdin.close()  # the engine exits at EOF between decode steps, batch unfinished
        assert eng.proc.wait(timeout=60) == 0
