"""A training op sent while a long sample batch of the same base model decodes on the same agent.

The engine serves training ops between decode steps (docs/engine-protocol.md), so the
forward_backward must come back while the sample is still generating, not after it. Prints one
JSON line: when each finished, counted from the sample's submit, and how long the forward_backward
took (the figure docs/benchmarks.md records; the test asserts the order only).

    python test/e2e/sdk_train_during_sample.py <base_model> [max_tokens=2000] [num_samples=8]
"""
import json
import sys
import threading
import time

import numpy as np
import tinker
from tinker import types


def main() -> None:
    base_model = sys.argv[1]
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    num_samples = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    service = tinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=base_model, rank=8, seed=3).result()
    tokens = [5, 17, 300, 42, 9, 77]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "weights": np.ones(len(tokens) - 1, dtype=np.float32)},
    )
    tc.forward_backward([datum], "cross_entropy").result()  # the model exists and has run once
    sampler = service.create_sampling_client(base_model=base_model).result()
    # stop=[]: no stop at all, not even EOS, so every sequence runs to max_tokens.
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=11, stop=[])

    done: dict[str, float] = {}
    start = time.perf_counter()
    future = sampler.sample(types.ModelInput.from_ints([5, 17, 300]), num_samples=num_samples, sampling_params=params)
    result: dict[str, object] = {}

    def wait_sample() -> None:
        result["sample"] = future.result()
        done["sample_s"] = time.perf_counter() - start

    waiter = threading.Thread(target=wait_sample)
    waiter.start()
    time.sleep(1.0)  # the batch is decoding by now (it takes several seconds on a CPU)
    sent = time.perf_counter()
    fb = tc.forward_backward([datum], "cross_entropy").result()
    done["fb_s"] = time.perf_counter() - start
    fb_latency = time.perf_counter() - sent
    waiter.join()
    sample = result["sample"]
    lengths = [len(s.tokens) for s in sample.sequences]  # type: ignore[attr-defined]
    print(json.dumps({
        "fb_sent_s": sent - start,
        "fb_latency_s": fb_latency,
        "fb_done_s": done["fb_s"],
        "sample_done_s": done["sample_s"],
        "sample_lengths": lengths,
        "fb_loss": fb.metrics["loss:sum"],
    }))


if __name__ == "__main__":
    main()
