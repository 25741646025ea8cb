"""Calls every public method of the pinned Tinker SDK (0.38) against the server.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_probe.py MODEL
Prints one JSON object: {"<Class>.<method>": "ok" | "<ExceptionType>: <message>"}.
The test asserts that everything is "ok" except the documented gaps (README).
"""
import json
import os
import sys
import traceback

import numpy as np
import tinker
import torch
from tinker import types

results: dict[str, str] = {}


def probe(name: str, fn):
    try:
        value = fn()
        results[name] = "ok"
        return value
    except Exception as e:  # noqa: BLE001 - the probe reports whatever the SDK raised
        results[name] = f"{type(e).__name__}: {e}"
        if "--verbose" in sys.argv:
            traceback.print_exc()
        return None


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def main() -> None:
    model = sys.argv[1]
    os.environ.setdefault("TINKER_PROJECT_ID", "probe-project")  # copy_weights needs a destination project
    svc = tinker.ServiceClient()
    probe("ServiceClient.get_server_capabilities", lambda: svc.get_server_capabilities())
    probe("ServiceClient.get_console_url", lambda: svc.get_console_url())
    tc = probe("ServiceClient.create_lora_training_client", lambda: svc.create_lora_training_client(base_model=model, rank=4, seed=3).result())
    assert tc is not None, results
    probe("TrainingClient.get_info", lambda: tc.get_info())
    tok = probe("TrainingClient.get_tokenizer", lambda: tc.get_tokenizer())
    probe("TrainingClient.get_console_url", lambda: tc.get_console_url())
    probe("TrainingClient.get_telemetry", lambda: tc.get_telemetry())

    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
            loss_fn_inputs={"target_tokens": np.array([2, 3, 4, 5], dtype=np.int64), "weights": np.array([0, 1, 1, 1], dtype=np.float32)},
        ),
        types.Datum(model_input=types.ModelInput.from_ints([9, 8]), loss_fn_inputs={"target_tokens": [8, 7], "weights": [1.0, 1.0]}),
    ]
    rl = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-1.0, -2.0, -1.5], "advantages": [0.5, -0.5, 1.0]},
        )
    ]
    probe("TrainingClient.forward_backward", lambda: tc.forward_backward(datums, "cross_entropy").result())
    probe("TrainingClient.forward", lambda: tc.forward(rl, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result())

    def custom_loss(data, logprobs_list):
        loss = sum((-lp).sum() for lp in logprobs_list)
        return loss, {"custom:sum": float(loss)}

    probe("TrainingClient.forward_backward_custom", lambda: tc.forward_backward_custom(datums, custom_loss).result())
    handle = probe("ServiceClient.create_custom_loss", lambda: svc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result())
    if handle is not None:
        probe("TrainingClient.forward_backward_custom (LossHandle)", lambda: tc.forward_backward_custom(datums, handle).result())
    probe("TrainingClient.optim_step", lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).result())
    state = probe("TrainingClient.save_state", lambda: tc.save_state("ckpt-1").result())
    if state is not None:
        probe("TrainingClient.load_state", lambda: tc.load_state(state.path).result())
        probe("TrainingClient.load_state_with_optimizer", lambda: tc.load_state_with_optimizer(state.path).result())
    sw = probe("TrainingClient.save_weights_for_sampler", lambda: tc.save_weights_for_sampler("samp-1").result())
    probe("TrainingClient.save_weights_external", lambda: tc.save_weights_external("ext-1").result())
    sc = None
    if sw is not None:
        sc = probe("ServiceClient.create_sampling_client", lambda: svc.create_sampling_client(model_path=sw.path).result())
        probe("TrainingClient.create_sampling_client", lambda: tc.create_sampling_client(sw.path).result())
    probe("TrainingClient.save_weights_and_get_sampling_client", lambda: tc.save_weights_and_get_sampling_client().result())
    if sc is not None:
        probe(
            "SamplingClient.sample",
            lambda: sc.sample(
                types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=3, temperature=0.7, stop=["\n"], seed=5),
                include_prompt_logprobs=True, topk_prompt_logprobs=2,
            ).result(),
        )
        probe("SamplingClient.compute_logprobs", lambda: sc.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result())
        probe("SamplingClient.get_base_model", lambda: sc.get_base_model())
        probe("SamplingClient.get_tokenizer", lambda: sc.get_tokenizer())
        probe("SamplingClient.get_telemetry", lambda: sc.get_telemetry())
        probe("SamplingClient.on_queue_state_change", lambda: sc.on_queue_state_change(tinker.lib.api_future_impl.QueueState.ACTIVE, None))
        handle = probe("SamplingClient.get_sampler_handle", lambda: sc.get_sampler_handle())
        if handle is not None:
            clone = probe("SamplingClient.from_sampler_handle", lambda: tinker.SamplingClient.from_sampler_handle(handle))
            if clone is not None:
                probe("SamplingClient.sample (from handle)", lambda: clone.sample(types.ModelInput.from_ints([4, 5]), 1, types.SamplingParams(max_tokens=2, seed=1)).result())
        probe("SamplingClient.create", lambda: tinker.SamplingClient.create(tc.holder, base_model=model).result())

    rc = probe("ServiceClient.create_rest_client", lambda: svc.create_rest_client())
    if rc is not None:
        probe("RestClient.get_server_capabilities", lambda: rc.get_server_capabilities().result())
        probe("RestClient.list_training_runs", lambda: rc.list_training_runs().result())
        probe("RestClient.get_training_run", lambda: rc.get_training_run(tc.model_id).result())
        probe("RestClient.list_checkpoints", lambda: rc.list_checkpoints(tc.model_id).result())
        probe("RestClient.list_user_checkpoints", lambda: rc.list_user_checkpoints().result())
        probe("RestClient.list_sessions", lambda: rc.list_sessions().result())
        if state is not None:
            probe("RestClient.get_training_run_by_tinker_path", lambda: rc.get_training_run_by_tinker_path(state.path).result())
            probe("RestClient.get_weights_info_by_tinker_path", lambda: rc.get_weights_info_by_tinker_path(state.path).result())
            probe("RestClient.set_checkpoint_ttl_from_tinker_path", lambda: rc.set_checkpoint_ttl_from_tinker_path(state.path, 7200).result())
            probe("RestClient.publish_checkpoint_from_tinker_path", lambda: rc.publish_checkpoint_from_tinker_path(state.path).result())
            probe("RestClient.unpublish_checkpoint_from_tinker_path", lambda: rc.unpublish_checkpoint_from_tinker_path(state.path).result())
            tc2 = probe("ServiceClient.create_training_client_from_state", lambda: svc.create_training_client_from_state(state.path).result())
            tc3 = probe(
                "ServiceClient.create_training_client_from_state_with_optimizer",
                lambda: svc.create_training_client_from_state_with_optimizer(state.path).result(),
            )
            probe("ServiceClient.copy_weights", lambda: svc.copy_weights(state.path).result())
            probe("RestClient.copy_weights", lambda: rc.copy_weights(state.path).result())
        if sc is not None:
            probe("RestClient.get_sampler", lambda: rc.get_sampler(sc._sampling_session_id).result())
        probe("RestClient.get_session", lambda: rc.get_session(tc.holder.get_session_id()).result())
        probe("RestClient.search_sessions", lambda: rc.search_sessions(types.SessionSearchRequest()).result())
        probe("RestClient.assign_session_project", lambda: rc.assign_session_project(tc.holder.get_session_id(), "proj").result())
        probe("RestClient.export_session_trace", lambda: rc.export_session_trace(tc.holder.get_session_id()).result())
        probe("RestClient.get_audit_log", lambda: rc.get_audit_log().result())
        probe("RestClient.get_billing_usage", lambda: rc.get_billing_usage("2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z").result())
        probe("RestClient.get_current_checkpoint_storage_usage", lambda: rc.get_current_checkpoint_storage_usage().result())
        probe("RestClient.whoami", lambda: rc.whoami().result())
        probe("RestClient.get_external_weights_urls", lambda: rc.get_external_weights_urls(f"tinker://{tc.model_id}/external_weights/ext-1").result())
        if sw is not None:
            probe("RestClient.delete_checkpoint_from_tinker_path", lambda: rc.delete_checkpoint_from_tinker_path(sw.path).result())
        probe("RestClient.get_telemetry", lambda: rc.get_telemetry())
    probe("ServiceClient.get_telemetry", lambda: svc.get_telemetry())
    probe("ServiceClient.close", lambda: svc.close("success", "probe done").result())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
