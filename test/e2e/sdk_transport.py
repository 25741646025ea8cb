"""The SDK's transport as this server configures it (/client/config): pyqwest, zstd forward_backward bodies.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_transport.py MODEL_ALIAS BASE_MODEL_DIR

Run against a server with a short long-poll and a sampling queue of one (the test sets them), so
that long-polls end in try_again and concurrent samples are refused with 429 and resent. Prints one
JSON object:
- the flags the SDK resolved, and the transport class of each connection pool it opened;
- a forward_backward of one datum with (N, K) top-K targets (a body of several MB), its loss:sum and
  logprobs against a torch reference computed here (a fresh adapter has B = 0: the base model's
  logprobs), and the same datum through forward (forward_only);
- how many bodies the SDK compressed, and how many try_again replies its futures received;
- concurrent samples, all answered;
- the errors the SDK raised for bad requests, as `Type: message`.
"""
from __future__ import annotations

import json
import logging
import sys

import numpy as np
import tinker
import tinker.resources.training as training_resource
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from sdk_common import error_of

N, K = 2000, 128  # tokens of the large datum, and its top-K width: ~3 MB of protobuf


class Counter(logging.Handler):
    """Counts the records of one logger whose message contains `needle`."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.DEBUG)
        self.needle = needle
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.count += 1


def count_compressions() -> list[int]:
    """Wraps the SDK's zstd compressor so every body it compresses is counted (with its size)."""
    sizes: list[int] = []
    real = training_resource.zstd.ZstdCompressor

    class Counting:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self._compressor = real(*args, **kwargs)

        def compress(self, data: bytes) -> bytes:
            sizes.append(len(data))
            return self._compressor.compress(data)

    training_resource.zstd.ZstdCompressor = Counting
    return sizes


def reference(base_dir: str, tokens: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> tuple[float, np.ndarray]:
    """loss:sum and the (N, K) target logprobs of the base model, in float32 on the CPU."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor(tokens)[None]).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(targets))
    return float(-(lp * torch.tensor(weights)).sum()), lp.numpy()


def main() -> None:
    model, base_dir = sys.argv[1], sys.argv[2]
    compressed = count_compressions()
    try_again = Counter("because of try_again")
    future_log = logging.getLogger("tinker.lib.api_future_impl")
    future_log.addHandler(try_again)
    future_log.setLevel(logging.DEBUG)

    service = tinker.ServiceClient()
    out: dict[str, object] = {}
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=0).result()

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=N + 1)
    targets = np.stack([rng.choice(1000, size=K, replace=False) for _ in range(N)]).astype(np.int64)
    targets[:, 0] = tokens[1:]
    weights = rng.dirichlet(np.ones(K), size=N).astype(np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    ref_loss, ref_lp = reference(base_dir, tokens[:-1], targets, weights)
    fwd = tc.forward([datum], "cross_entropy").result(timeout=300)
    fb = tc.forward_backward([datum], "cross_entropy").result(timeout=300)
    lp_fwd = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].to_numpy()).reshape(N, K)
    lp_fb = np.asarray(fb.loss_fn_outputs[0]["logprobs"].to_numpy()).reshape(N, K)
    out["large"] = {
        "body_bytes": max(compressed) if compressed else 0,
        "loss_server": fb.metrics["loss:sum"],
        "loss_forward": fwd.metrics["loss:sum"],
        "loss_ref": ref_loss,
        "max_logprob_diff": float(max(np.abs(lp_fb - ref_lp).max(), np.abs(lp_fwd - ref_lp).max())),
    }
    out["optim"] = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120).metrics

    # A sample that outlasts the long poll (try_again), and more at once than the queue admits (429, resent).
    sampler = tc.save_weights_and_get_sampling_client(name="transport").result()
    long = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=1024, seed=7))
    futures = [
        sampler.sample(types.ModelInput.from_ints([1, 2, 3, i]), 1, types.SamplingParams(max_tokens=64, seed=i))
        for i in range(6)
    ]
    out["samples"] = [len(f.result(timeout=300).sequences[0].tokens) for f in futures]
    out["long_sample"] = len(long.result(timeout=300).sequences[0].tokens)

    out["errors"] = {
        "oov_token": error_of(
            lambda: tc.forward_backward(
                [types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": np.array([6, 999999], dtype=np.int64), "weights": np.ones(2, dtype=np.float32)})],
                "cross_entropy",
            ).result(timeout=60)
        ),
        "unknown_model": error_of(lambda: service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result(timeout=60)),
        "unknown_run": error_of(lambda: tinker.RestClient().get_training_run("no-such-run").result(timeout=60)),
    }
    # The client keeps working after them.
    out["after_errors_loss"] = tc.forward_backward([datum], "cross_entropy").result(timeout=300).metrics["loss:sum"]

    holder = tc.holder
    config = holder.get_client_config()
    out["config"] = {"use_pyqwest_transport": config.use_pyqwest_transport, "proto_compress_fwdbwd": config.proto_compress_fwdbwd}
    out["transports"] = {
        pool_type.value: sorted({type(c._client._transport).__name__ for c in pool._clients})
        for pool_type, pool in holder._client_pools.items()
    }
    out["compressed_bodies"] = len(compressed)
    out["try_again"] = try_again.count
    print(json.dumps(out))


if __name__ == "__main__":
    main()
