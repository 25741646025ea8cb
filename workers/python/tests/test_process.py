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
import torch

from helpers import adam, lora, sampling
from tinker_engine.channel import Channel, FrameError, decode_frame, encode_frame

PY_ROOT = Path(__file__).resolve().parents[1]
# The sample request fields the agent always sends (protocol.json), here asking for nothing.
NO_SCORES = {"target_prompt_logprobs": None, "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0}


class EngineProcess:
    def __init__(self) -> None:
        path = os.pathsep.join(p for p in (str(PY_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "TB_ENGINE_DEVICE": "cpu"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tinker_engine"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.next_id = 100

    def send_raw(self, frame: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame)
        self.proc.stdin.flush()

    def read_reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        header = self.proc.stdout.read(4)
        assert len(header) == 4, "engine closed stdout"
        (n,) = struct.unpack(">I", header)
        return decode_frame(self.proc.stdout.read(n))

    def request(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        self.send_raw(encode_frame({"id": self.next_id, "op": op, "args": args}))
        reply = self.read_reply()
        assert reply["id"] == self.next_id
        return reply


def test_engine_process_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    eng = EngineProcess()
    try:
        hello = eng.request("hello", {})
        assert hello == {"id": hello["id"], "ok": True,
                         "result": {"protocol": 2, "engine": "torch", "device": "cpu",
                                    "torch": hello["result"]["torch"]}}
        base = eng.request("load_base", {"name": "tiny", "path": str(tiny_model_dir)})["result"]
        assert base["vocab_size"] == 1029 and base["arch"] == "Qwen3ForCausalLM"
        assert base["max_context_length"] == 2048 and base["eos_token_id"] == 1026
        assert eng.request("load_base", {"name": "tiny", "path": str(tiny_model_dir)})["result"] == base
        created = eng.request("create_model", {"model_id": "e2e", "base_model": "tiny", "lora": lora(8)})
        assert created["result"] == {"model_id": "e2e", "lora_rank": 8}

        tokens = [5, 17, 300, 42, 9]
        # Tensors travel as binary (encode_frame sends a torch.Tensor's bytes), tokens as int32 as the agent sends them.
        data = [{"tokens": torch.tensor(tokens, dtype=torch.int32), "loss_fn_inputs": {
            "target_tokens": torch.tensor(tokens[1:] + [1], dtype=torch.int64),
            "weights": torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])}}]
        fb_args = {"model_id": "e2e", "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False,
                   "data": data}
        losses = []
        for _ in range(3):
            fwd = eng.request("forward_backward", fb_args)
            assert fwd["ok"], fwd
            out = fwd["result"]["loss_fn_outputs"][0]["logprobs"]
            assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and list(out.shape) == [5]
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
                       "topk_prompt_logprobs": 2, **NO_SCORES}
        sampled = eng.request("sample", sample_args)
        assert sampled["ok"], sampled
        assert [len(s["tokens"]) for s in sampled["result"]["sequences"]] == [4, 4]
        assert sampled["result"]["prompt_logprobs"][0] is None

        unknown = eng.request("explode", {})
        assert unknown["ok"] is False and unknown["error"]["category"] == "server"
        assert "unknown op 'explode'" in unknown["error"]["message"]

        bad = eng.request("forward_backward", {**fb_args, "data": [{**data[0], "tokens": torch.tensor([5, 17, 300, 42, 99999])}]})
        assert bad["ok"] is False and bad["error"]["category"] == "user"
        assert "outside the vocabulary" in bad["error"]["message"]

        # Args that break the op's schema (protocol.json) are refused before the op runs, naming the field.
        off = eng.request("optim_step", {"model_id": "e2e", "adam": {**adam(), "lr": 1.0}})
        assert off["ok"] is False and off["error"]["category"] == "user"
        assert off["error"]["message"] == "optim_step: args.adam: unknown field 'lr'"
        listed = eng.request("forward_backward", {**fb_args, "data": [{**data[0], "tokens": [5, 17, 300, 42, 9]}]})
        assert listed["ok"] is False and "args.data[0].tokens: must be a tensor" in listed["error"]["message"]

        eng.send_raw(frame(b"{not json"))
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


def frame(json_part: bytes, blob: bytes = b"") -> bytes:
    """A protocol-2 frame by hand: lengths, JSON, tensor bytes."""
    return struct.pack(">II", 4 + len(json_part) + len(blob), len(json_part)) + json_part + blob


def test_channel_framing_round_trip() -> None:
    reader = io.BytesIO(encode_frame({"id": 1, "op": "hello"}) + encode_frame({"id": 2}) + b"\x00\x00")
    writer = io.BytesIO()
    ch = Channel(reader, writer)
    assert decode_frame(ch.read()) == {"id": 1, "op": "hello"}
    assert decode_frame(ch.read()) == {"id": 2}
    assert ch.read() is None  # a truncated header is a closed channel
    lp = torch.tensor([[-0.5, -1.25e-7, float("nan")]], dtype=torch.float64)
    ch.write({"id": 3, "ok": True, "result": {"x": float("nan"), "y": [1.5, float("inf")], "lp": lp,
                                              "ids": torch.tensor([3, 2**40], dtype=torch.int64)}})
    raw = writer.getvalue()
    assert struct.unpack(">I", raw[:4])[0] == len(raw) - 4
    (j,) = struct.unpack(">I", raw[4:8])
    assert (4 + j) % 8 == 0  # the JSON is space-padded: tensor bytes start 8-aligned in the body
    head = json.loads(raw[8:8 + j])
    # Tensors are bytes after the JSON, never number lists in it; each starts at a multiple of 8.
    assert head["result"]["lp"] == {"dtype": "float32", "shape": [1, 3], "bin": [0, 12]}
    assert head["result"]["ids"] == {"dtype": "int64", "shape": [2], "bin": [16, 16]}
    back = decode_frame(raw[4:])
    assert back["result"]["x"] is None and back["result"]["y"] == [1.5, None]
    assert torch.equal(back["result"]["lp"][0, :2], lp[0, :2].float()) and torch.isnan(back["result"]["lp"][0, 2])
    assert back["result"]["ids"].tolist() == [3, 2**40]


@pytest.mark.parametrize("blob,ref,why", [
    (b"\x00" * 8, {"dtype": "float32", "shape": [3], "bin": [0, 12]}, "lie outside"),
    (b"\x00" * 16, {"dtype": "float32", "shape": [3], "bin": [0, 16]}, "needs 12 bytes"),
    (b"\x00" * 16, {"dtype": "float16", "shape": [2], "bin": [0, 4]}, "unknown tensor dtype"),
    (b"\x00" * 16, {"dtype": "int32", "shape": [-1], "bin": [0, 4]}, "non-negative"),
    (b"", {"dtype": "int64", "shape": [1], "bin": [2**62, 8]}, "lie outside"),
])
def test_hostile_tensor_references_are_refused(blob: bytes, ref: dict[str, Any], why: str) -> None:
    body = frame(json.dumps({"id": 1, "op": "hello", "args": {"t": ref}}).encode(), blob)[4:]
    with pytest.raises(FrameError, match=why):
        decode_frame(body)


@pytest.mark.parametrize("payload", [b"[]", b'{"id": "x", "op": "hello"}', b'{"id": 1, "op": "hello", "args": 3}'])
def test_malformed_requests_get_error_replies(payload: bytes) -> None:
    from tinker_engine.device import Placement
    from tinker_engine.engine import Engine

    reply = Engine(Placement(torch.device("cpu"), torch.float32)).reply(frame(payload)[4:])
    assert reply["ok"] is False and reply["error"]["category"] == "server"
    short = Engine(Placement(torch.device("cpu"), torch.float32)).reply(b"\x00\x00")
    assert short["ok"] is False and "no JSON length" in short["error"]["message"]


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
            {"adapter_dir": None, "prompt": [5, 17, 300], "num_samples": 8, "prompt_logprobs": False,
             "topk_prompt_logprobs": 0, "sampling_params": sampling(max_tokens=2000, seed=1, stop_at_eos=False),
             **NO_SCORES}]}
        eng.send_raw(encode_frame({"id": 1, "op": "sample_batch", "args": long_sample}))
        time.sleep(0.5)  # the batch is decoding
        tokens = [5, 17, 300, 42]
        fb_args = {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False,
                   "data": [{"tokens": torch.tensor(tokens), "loss_fn_inputs": {
                       "target_tokens": torch.tensor(tokens[1:] + [1])}}]}
        sent = time.perf_counter()
        eng.send_raw(encode_frame({"id": 2, "op": "forward_backward", "args": fb_args}))
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
