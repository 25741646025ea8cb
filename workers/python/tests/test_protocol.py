"""The engine follows protocol.json (generated from workers/engine-protocol.ts): the same ops, and
every request checked against its op's schema with messages that name the field."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tinker_engine import PROTOCOL_VERSION
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError
from tinker_engine.protocol import OPS, VERSION, check_args, check_result, defaults, problem

from helpers import adam, lora, sampling

VERL_ENGINE = Path(__file__).resolve().parents[1] / "tinker_engine_verl" / "engine.py"


def test_the_torch_engine_answers_exactly_the_protocol_ops(engine: Engine) -> None:
    assert VERSION == PROTOCOL_VERSION == 2
    assert sorted(engine.ops) == sorted(OPS)


def test_the_verl_engine_answers_only_protocol_ops() -> None:
    # Read from its source: importing it needs verl.
    tree = ast.parse(VERL_ENGINE.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "forward_backward" for k in node.keys):
            names = {k.value for k in node.keys if isinstance(k, ast.Constant)}
    assert names and names <= set(OPS), names - set(OPS)
    assert {"hello", "load_base", "create_model", "forward_backward", "optim_step", "save_state", "load_state"} <= names


def test_requests_are_checked_against_their_op_schema() -> None:
    good = {"model_id": "m", "loss_fn": "cross_entropy", "loss_fn_config": {"x": 1, "y": "z"}, "forward_only": False,
            "data": [{"tokens": torch.tensor([1, 2]), "loss_fn_inputs": {
                "target_tokens": {"dtype": "int32", "shape": [2], "bin": [0, 8]},
                "weights": {"dtype": "float32", "shape": [2], "data": [1.0, 0.5]}}}]}
    check_args("forward_backward", good)
    cases = [
        ({**good, "extra": 1}, "args: unknown field 'extra'"),
        ({k: v for k, v in good.items() if k != "data"}, "args: missing required field 'data'"),
        ({**good, "data": []}, "args.data: needs at least 1 items"),
        ({**good, "forward_only": 1}, "args.forward_only: must be boolean, got int"),
        ({**good, "loss_fn_config": {"x": [1]}}, "args.loss_fn_config.x: must be number or string, got list"),
        ({**good, "model_id": ""}, "args.model_id: must not be empty"),
        ({**good, "data": [{"tokens": [1, 2], "loss_fn_inputs": {}}]}, "args.data[0].tokens: must be a tensor"),
        ({**good, "data": [{"tokens": {"dtype": "bf16", "shape": [1], "bin": [0, 2]}, "loss_fn_inputs": {}}]},
         "args.data[0].tokens: tensor dtype must be one of"),
    ]
    for args, message in cases:
        with pytest.raises(UserError) as err:
            check_args("forward_backward", args)
        assert str(err.value).startswith(f"forward_backward: {message}"), str(err.value)


def test_numbers_enums_nullables_and_tuples() -> None:
    opt = {"model_id": "m", "adam": adam()}
    check_args("optim_step", opt)
    with pytest.raises(UserError, match=r"args.adam.beta1: 1.0 breaks exclusiveMaximum 1"):
        check_args("optim_step", {**opt, "adam": {**adam(), "beta1": 1.0}})
    with pytest.raises(UserError, match="args.dtype: must be one of"):
        check_args("load_base", {"name": "a", "path": "/p", "dtype": "int8"})
    req = {"base_model": "b", "adapter_dir": None, "prompt": [1, 2], "num_samples": 1, "sampling_params": sampling(),
           "prompt_logprobs": False, "topk_prompt_logprobs": 0, "target_prompt_logprobs": None,
           "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0}
    check_args("sample", req)
    check_args("sample", {**req, "target_prompt_logprobs": {"k": 1, "ids": [3]}})
    with pytest.raises(UserError, match="args.adapter_dir: must be string or null"):
        check_args("sample", {**req, "adapter_dir": 3})
    with pytest.raises(UserError, match=r"args.prompt\[1\]: must be integer"):
        check_args("sample", {**req, "prompt": [1, 2.5]})
    assert problem([1, 0.5], OPS["sample"]["result"]["properties"]["topk_prompt_logprobs"]["anyOf"][0]["items"]
                   ["anyOf"][0]["items"], "x") is None
    one_of = {"oneOf": [{"type": "number"}, {"type": "integer"}]}
    assert problem("x", one_of, "v") == "v: must be number, got str"
    assert problem(3, one_of, "v") == "v: fits 2 of the alternatives; exactly one must fit"
    assert problem(3.5, one_of, "v") is None
    assert problem(["a", 0.5], {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "number"}],
                                "items": False}, "x") == "x[0]: must be integer, got str"


def test_defaults_are_read_from_the_schema_and_fields_stay_required() -> None:
    # The sampling and Adam defaults of queues/contract/params.ts, for in-process callers.
    adam_schema = OPS["optim_step"]["args"]["properties"]["adam"]
    assert defaults("optim_step", "adam") == {k: v["default"] for k, v in adam_schema["properties"].items()}
    assert set(defaults("sample", "sampling_params")) == set(sampling())
    # On the wire a default does not make a field optional: the agent sends every one.
    hp = adam()
    del hp["eps"]
    with pytest.raises(UserError, match=r"args.adam: missing required field 'eps'"):
        check_args("optim_step", {"model_id": "m", "adam": hp})


def test_results_are_checked_in_the_tests(engine: Engine, tiny_model_dir: Path) -> None:
    engine.call("create_model", {"model_id": "r", "base_model": "tiny", "lora": lora(4)})
    check_result("optim_step", engine.call("optim_step", {"model_id": "r", "adam": adam()}))
    with pytest.raises(RuntimeError, match="optim_step result breaks the protocol: result: unknown field 'extra'"):
        check_result("optim_step", {"metrics": {}, "extra": 1})
    with pytest.raises(RuntimeError, match="result.loss_fn_outputs"):
        check_result("forward_backward", {"loss_fn_outputs": [{"logprobs": [1.0]}], "metrics": {}})
