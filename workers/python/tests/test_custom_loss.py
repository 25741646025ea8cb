"""Server-side custom losses: the graph rebuilder's allowlist, hostile graphs, and forward_backward with
a custom loss against the SDK's own client-side semantics (run_loss_handle + the cross_entropy surrogate)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import adam, create, datum, fb, grads, params, perturb
from tinker_engine import custom_loss as cl
from tinker_engine.engine import Engine
from tinker_engine.errors import UserError
from tinker_engine.tensors import tensor_to_json

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.lib.public_interfaces.custom_loss import encode_graph, run_loss_handle, trace_loss  # noqa: E402


def ppo_like(logprobs, old, adv):
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * adv, clipped * adv).sum() + 0.01 * (logprobs ** 2).mean() * logprobs.shape[0]
    entropy = -(logprobs.exp() * logprobs).sum()
    return loss, {"custom/entropy:mean": entropy, "custom/clipped:sum": (ratio != clipped).float().sum(),
                  "custom/relu:sum": F.relu(logprobs + 1.0).sum() + math.log(2.0)}


def topk_loss(logprobs, dist):
    loss = -(dist * logprobs).sum() + torch.logsumexp(logprobs, dim=-1).mean()
    return loss, {"custom/first:mean": logprobs[:, 0].sum()}


def per_sequence(logprobs, old, adv, group):
    """A loss with rank-0 inputs: a per-datum advantage (float32) and group size (int64)."""
    ratio = torch.exp(logprobs - old)
    loss = -(ratio * adv).sum() / group + 0.01 * (logprobs ** 2).mean()
    return loss, {"custom/adv:mean": adv * 1.0, "custom/group:sum": group.float() + ratio.sum() * 0}


def handle_of(fn: Any, ranks: dict[str, int]):
    return trace_loss(fn, ranks, "session-1")


def spec_of(handle: Any) -> dict[str, Any]:
    """The custom loss as the API stores it and the agent sends it: the SDK's own encoding."""
    return {"name": handle.name, "inputs": [i.model_dump() for i in handle.inputs],
            "graph": encode_graph(handle).model_dump()}


def test_every_allowlisted_name_resolves() -> None:
    assert set(cl.FUNCTIONS) == set(cl.OPS["functions"])
    for name, fn in cl.FUNCTIONS.items():
        assert callable(fn), name
    for m in cl.METHODS:
        assert callable(getattr(torch.Tensor, m)), m
    assert set(cl.CREATORS) <= set(cl.FUNCTIONS) | cl.METHODS


@pytest.mark.parametrize("fn,ranks,shapes", [
    (ppo_like, {"logprobs": 1, "old": 1, "adv": 1}, [(7,), (7,), (7,)]),
    (topk_loss, {"logprobs": 2, "dist": 2}, [(5, 3), (5, 3)]),
    (per_sequence, {"logprobs": 1, "old": 1, "adv": 0, "group": 0}, [(7,), (7,), (), ()]),
])
def test_rebuilt_graph_equals_the_traced_one(fn: Any, ranks: dict[str, int], shapes: list[tuple[int, ...]]) -> None:
    handle = handle_of(fn, ranks)
    loss = cl.rebuild(**spec_of(handle))
    gen = torch.Generator().manual_seed(0)
    values = [-torch.rand(s, generator=gen) for s in shapes]
    expected, expected_metrics = handle.graph(*values)
    got, got_metrics = cl.run(loss, values)
    # The same torch ops on the same values, in the same order: bit for bit.
    assert torch.equal(got, expected)
    assert got_metrics.keys() == expected_metrics.keys()
    for k in got_metrics:
        assert torch.equal(got_metrics[k], expected_metrics[k]), k


def _graph(*nodes: dict[str, Any], inputs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A hand-written graph: a logprobs placeholder, the nodes, and an output of the last node's value."""
    last = nodes[-1]["name"] if nodes else "logprobs"
    body = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
            *({"args": [], "kwargs": {}, **n} for n in nodes),
            {"op": "output", "name": "output", "target": "output",
             "args": [{"tuple": [{"ref": last}, {"dict": {}}]}], "kwargs": {}}]
    return {"name": "evil", "inputs": inputs or [{"name": "logprobs", "rank": 1}], "graph": {"format": 1, "nodes": body}}


def _call(name: str, target: str, *args: Any, op: str = "call_function", **kwargs: Any) -> dict[str, Any]:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


LP = {"ref": "logprobs"}

# Each hostile graph, and what its refusal must say (the node is always named).
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("import", _graph(_call("imp", "builtins.__import__", "os")), "node 'imp' names 'builtins.__import__'"),
    ("importlib", _graph(_call("imp", "importlib.import_module", "os")), "node 'imp' calls 'importlib.import_module', which is not an allowed"),
    ("os.system", _graph(_call("sh", "os.system", "rm -rf /")), "node 'sh' calls 'os.system'"),
    ("open", _graph(_call("f", "builtins.open", "/etc/passwd")), "node 'f' calls 'builtins.open'"),
    ("eval", _graph(_call("e", "eval", "1+1")), "node 'e' calls 'eval'"),
    ("exec", _graph(_call("e", "builtins.exec", "print(1)")), "node 'e' calls 'builtins.exec'"),
    ("torch.load", _graph(_call("t", "torch.load", "/tmp/x")), "node 't' calls 'torch.load'"),
    ("torch.save", _graph(_call("t", "torch.save", LP, "/tmp/x")), "node 't' calls 'torch.save'"),
    ("torch.ops", _graph(_call("t", "torch.ops.aten.add", LP, LP)), "node 't' calls 'torch.ops.aten.add'"),
    ("dunder attr __class__", _graph(_call("c", "getattr", LP, "__class__")), "node 'c' reads the attribute '__class__'"),
    ("dunder attr __globals__", _graph(_call("g", "getattr", LP, "__globals__")), "node 'g' reads the attribute '__globals__'"),
    ("attr outside the list", _graph(_call("g", "getattr", LP, "grad_fn")), "node 'g' reads the attribute 'grad_fn'"),
    ("dunder method", _graph(_call("r", "__reduce_ex__", LP, 2, op="call_method")), "node 'r' names '__reduce_ex__'"),
    ("dunder function", _graph(_call("r", "torch.__dict__", LP)), "node 'r' names 'torch.__dict__'"),
    ("method outside the list", _graph(_call("n", "numpy", LP, op="call_method")), "node 'n' calls the method 'numpy'"),
    ("in-place method", _graph(_call("n", "add_", LP, 1.0, op="call_method")), "node 'n' calls the method 'add_'"),
    ("backward", _graph(_call("n", "backward", LP, op="call_method")), "node 'n' calls the method 'backward'"),
    ("out kwarg", _graph(_call("n", "torch.exp", LP, out=LP)), "node 'n' passes out="),
    ("inplace kwarg", _graph(_call("n", "torch.nn.functional.relu", LP, inplace=True)), "node 'n' passes inplace=True"),
    ("to device", _graph(_call("n", "to", LP, "cuda", op="call_method")), "node 'n' calls to() with something other than a dtype"),
    ("get_attr", _graph({"op": "get_attr", "name": "w", "target": "weight"}), "node 'w' reads the attribute 'weight' of the traced module (get_attr)"),
    ("call_module", _graph({"op": "call_module", "name": "m", "target": "linear", "args": [LP]}), "node 'm' calls the module 'linear'"),
    ("unknown ref", _graph(_call("a", "torch.exp", {"ref": "nowhere"})), "node 'a' refers to 'nowhere', which is not a node defined before it"),
    ("self ref (cycle)", _graph(_call("a", "torch.exp", {"ref": "a"})), "node 'a' refers to 'a', which is not a node defined before it"),
    ("forward ref", _graph(_call("a", "torch.exp", {"ref": "b"}), _call("b", "torch.exp", LP)), "node 'a' refers to 'b'"),
    ("duplicate name", _graph(_call("a", "torch.exp", LP), _call("a", "torch.log", LP)), "node 'a' is defined twice"),
    ("huge int constant", _graph(_call("z", "torch.zeros", 10**12)), "node 'z' has the integer constant 1000000000000"),
    ("big list", _graph(_call("z", "torch.tensor", list(range(1000)))), "node 'z' has a list of 1000 items"),
    ("long string", _graph(_call("z", "torch.sum", LP, "x" * 1000)), "node 'z' has a string constant longer than"),
    ("deep nesting", _graph(_call("z", "torch.tensor", [[[[[[[[[[1.0]]]]]]]]]])), "node 'z' nests its arguments deeper than"),
    ("unknown arg kind", _graph(_call("z", "torch.exp", {"pickle": "gASV"})), "node 'z' has an argument of unknown kind 'pickle'"),
    ("bad dtype", _graph(_call("z", "to", LP, {"dtype": "object"}, op="call_method")), "node 'z' names dtype 'object'"),
    ("bad node op", _graph({"op": "call_python", "name": "z", "target": "x"}), "node 'z' has op 'call_python'"),
]


@pytest.mark.parametrize("what,spec,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_graphs_are_refused_naming_the_node(what: str, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as exc:
        cl.rebuild(**spec)
    assert message in str(exc.value), str(exc.value)


# Graphs whose constants are small but whose tensors would be huge: refused at run time, before the allocation.
RUNTIME_BOMBS: list[tuple[str, dict[str, Any], str]] = [
    ("torch.full", _graph(_call("z", "torch.full", [100000, 100000], 1.0)), "node 'z' (torch.full) asks for 10000000000 elements"),
    ("torch.ones sizes", _graph(_call("z", "torch.ones", 4096, 4096, 4096)), "node 'z' (torch.ones) asks for 68719476736 elements"),
    ("new_zeros", _graph(_call("z", "new_zeros", LP, [1 << 20, 1 << 20], op="call_method")), "node 'z' (new_zeros) asks for"),
    ("repeat", _graph(_call("z", "repeat", LP, 1 << 20, op="call_method")), "node 'z' (repeat) asks for"),
    ("expand", _graph(_call("u", "unsqueeze", LP, 0, op="call_method"),
                      _call("z", "expand", {"ref": "u"}, 1 << 20, -1, op="call_method")),
     # expand makes a view (no memory); the check after the call refuses it before any node uses it.
     "node 'z' (expand) made 5242880000 elements"),
    ("arange", _graph(_call("z", "torch.arange", 0.0, 1e9, 0.5)), "node 'z' (torch.arange) asks for 2000000000 elements"),
    ("broadcast", _graph(_call("a", "unsqueeze", LP, 0, op="call_method"), _call("b", "unsqueeze", LP, 1, op="call_method"),
                         _call("c", "operator.mul", {"ref": "a"}, {"ref": "b"})), "node 'c' (operator.mul) broadcasts to [5000, 5000]"),
    ("int growth", _graph(_call("s", "getattr", LP, "shape"), _call("n", "operator.getitem", {"ref": "s"}, 0),
                          _call("p", "operator.pow", {"ref": "n"}, 1000)), "node 'p' raises an integer to the power 1000"),
]


@pytest.mark.parametrize("what,spec,message", RUNTIME_BOMBS, ids=[b[0] for b in RUNTIME_BOMBS])
def test_huge_tensors_are_refused_before_they_are_made(what: str, spec: dict[str, Any], message: str) -> None:
    loss = cl.rebuild(**spec)  # structurally fine: small constants
    with pytest.raises(UserError) as exc:
        cl.run(loss, [torch.zeros(5000)])
    assert message in str(exc.value), str(exc.value)


def test_placeholders_must_match_the_declared_inputs() -> None:
    spec = _graph(inputs=[{"name": "logprobs", "rank": 1}, {"name": "adv", "rank": 1}])
    with pytest.raises(UserError, match="1 placeholders but 2 declared inputs|has no output|placeholder"):
        cl.rebuild(**spec)
    spec = _graph(_call("a", "torch.exp", LP))
    spec["graph"]["nodes"][0]["target"] = "adv"
    with pytest.raises(UserError, match="node 'logprobs' is the placeholder of 'adv', but input 0 is 'logprobs'"):
        cl.rebuild(**spec)
    too_many = _graph(*(_call(f"n{i}", "torch.exp", LP) for i in range(cl.OPS["max_nodes"] + 1)))
    with pytest.raises(UserError, match=f"at most {cl.OPS['max_nodes']}"):
        cl.rebuild(**too_many)


# --- forward_backward with a custom loss equals the SDK's client-side path ------------------------------


def _rl_data(vocab: int, seed: int, lengths: tuple[int, ...] = (9, 5, 7)) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out.append(datum(tokens, torch.tensor(tokens[1:] + [0]), old=-3.0 - torch.rand(n, generator=gen),
                         adv=torch.randn(n, generator=gen), weights=torch.ones(n)))
    return out


def _client_side(engine: Engine, model_id: str, handle: Any, data: list[dict[str, Any]]) -> dict[str, Any]:
    """What the SDK does without server-side losses: a forward, run_loss_handle on leaf logprobs, then
    a cross_entropy forward_backward with weights = -dC/dlogprobs (training_client._compute_custom_loss)."""
    forward = fb(engine, model_id, "cross_entropy", data, forward_only=True)
    logprobs = [o["logprobs"].clone().detach().requires_grad_(True) for o in forward["loss_fn_outputs"]]
    sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]),
                            loss_fn_inputs={k: types.TensorData(data=v["data"], dtype=v["dtype"], shape=v["shape"])
                                            for k, v in d["loss_fn_inputs"].items()}) for d in data]
    loss, metrics = run_loss_handle(handle, sdk_data, logprobs)
    loss_sum = float(loss.detach().sum().item())
    loss.backward()
    surrogate = copy.deepcopy(data)
    for d, lp in zip(surrogate, logprobs):
        d["loss_fn_inputs"] = {"target_tokens": d["loss_fn_inputs"]["target_tokens"],
                               "weights": {"dtype": "float32", "shape": list(lp.shape), "data": (-lp.grad).tolist()}}
    result = fb(engine, model_id, "cross_entropy", surrogate)
    return {**result, "metrics": {**metrics, "loss:sum": loss_sum}}


def test_forward_backward_custom_equals_the_client_side_run(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    handle = handle_of(ppo_like, {"logprobs": 1, "old": 1, "adv": 1})
    for m in ("server", "client"):
        create(engine, m, seed=2)
        perturb(engine, m, seed=4)
    data = _rl_data(vocab, seed=5)
    server = engine.call("forward_backward", {"model_id": "server", "loss_fn": "custom", "loss_fn_config": {"loss_id": "x"},
                                              "forward_only": False, "data": data, "custom_loss": spec_of(handle)})
    client = _client_side(engine, "client", handle, data)
    # Same forward (same micro-batches), same graph on the same logprobs, same summation order: the
    # loss and metrics agree to float32 rounding of one sum of three datums; the gradient reaching the
    # logprobs is dC/dlp in both (the surrogate's backward gives -(-g) = g exactly), so the adapter's
    # gradients agree to the rounding of the backward's own sums.
    assert server["metrics"]["loss:sum"] == pytest.approx(client["metrics"]["loss:sum"], rel=1e-6, abs=1e-6)
    assert set(server["metrics"]) == set(client["metrics"])
    for k, v in client["metrics"].items():
        assert server["metrics"][k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    for a, b in zip(server["loss_fn_outputs"], client["loss_fn_outputs"]):
        assert torch.allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-6)
    for (n, a), b in zip(grads(engine, "server").items(), grads(engine, "client").values()):
        assert a is not None and b is not None
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), n
    hp = adam(lr=0.05, eps=1e-3)
    engine.call("optim_step", {"model_id": "server", "adam": hp})
    engine.call("optim_step", {"model_id": "client", "adam": hp})
    for (n, a), b in zip(params(engine, "server").items(), params(engine, "client").values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), n


def test_custom_loss_user_errors_leave_gradients_unchanged(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    handle = handle_of(ppo_like, {"logprobs": 1, "old": 1, "adv": 1})
    create(engine, "m", seed=2)
    data = _rl_data(vocab, seed=1)
    fb(engine, "m", "cross_entropy", data)
    before = grads(engine, "m")
    missing = copy.deepcopy(data)
    del missing[1]["loss_fn_inputs"]["adv"]
    wrong_rank = copy.deepcopy(data)
    wrong_rank[0]["loss_fn_inputs"]["target_tokens"] = {"dtype": "int64", "shape": [9, 1],
                                                        "data": [[t] for t in data[0]["loss_fn_inputs"]["target_tokens"]["data"]]}
    wrong_rank[0]["loss_fn_inputs"]["target_tokens"]["data"] = data[0]["loss_fn_inputs"]["target_tokens"]["data"]
    bomb = _graph(_call("z", "torch.full", [100000, 100000], 1.0))
    cases = [
        (missing, spec_of(handle), "datum 1: custom loss 'ppo_like' reads loss_fn_inputs['adv'], which the datum lacks"),
        (wrong_rank, spec_of(handle), "datum 0: target_tokens must be int64 of rank 1"),
        (data, bomb, "node 'z' (torch.full) asks for 10000000000 elements"),
    ]
    for d, spec, message in cases:
        with pytest.raises(UserError) as exc:
            engine.call("forward_backward", {"model_id": "m", "loss_fn": "custom", "loss_fn_config": {"loss_id": "x"},
                                             "forward_only": False, "data": d, "custom_loss": spec})
        assert message in str(exc.value)
        for (n, a), b in zip(grads(engine, "m").items(), before.values()):
            assert torch.equal(a, b), n


def test_topk_custom_loss_runs_on_rank_2_logprobs(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    handle = handle_of(topk_loss, {"logprobs": 2, "dist": 2})
    create(engine, "k", seed=3)
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, vocab, (6,), generator=gen).tolist()
    d = datum(tokens, torch.randint(0, vocab, (6, 3), generator=gen), dist=torch.softmax(torch.randn(6, 3, generator=gen), -1))
    r = engine.call("forward_backward", {"model_id": "k", "loss_fn": "custom", "loss_fn_config": {"loss_id": "x"},
                                         "forward_only": True, "data": [d], "custom_loss": spec_of(handle)})
    lp = r["loss_fn_outputs"][0]["logprobs"]
    assert lp.shape == (6, 3)
    expected, metrics = handle.graph(lp, torch.tensor(d["loss_fn_inputs"]["dist"]["data"]).reshape(6, 3))
    assert r["metrics"]["loss:sum"] == pytest.approx(float(expected), rel=1e-6)
    assert r["metrics"]["custom/first:mean"] == pytest.approx(float(metrics["custom/first:mean"]), rel=1e-6)


def _scalar_data(vocab: int, seed: int, lengths: tuple[int, ...] = (9, 1, 6)) -> list[dict[str, Any]]:
    """Datums with rank-0 inputs as the API sends them (shape []), a one-token datum among them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for j, n in enumerate(lengths):
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        d = datum(tokens, torch.tensor(tokens[1:] + [0]), old=-3.0 - torch.rand(n, generator=gen))
        d["loss_fn_inputs"]["adv"] = tensor_to_json(torch.randn((), generator=gen))
        d["loss_fn_inputs"]["group"] = tensor_to_json(torch.tensor(j + 2, dtype=torch.int64))
        out.append(d)
    return out


def test_rank_0_inputs_reach_the_graph_as_0_d_tensors_and_equal_the_client_side_run(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    handle = handle_of(per_sequence, {"logprobs": 1, "old": 1, "adv": 0, "group": 0})
    seen: list[list[tuple[int, ...]]] = []
    real_run = cl.run

    def spy(loss: cl.CustomLoss, values: list[torch.Tensor]) -> Any:
        seen.append([tuple(v.shape) for v in values])
        return real_run(loss, values)

    for m in ("server", "client"):
        create(engine, m, seed=2)
        perturb(engine, m, seed=4)
    data = _scalar_data(vocab, seed=6)
    # The real run, recording the shapes the graph is given.
    monkeypatch.setattr(cl, "run", spy)
    server = engine.call("forward_backward", {"model_id": "server", "loss_fn": "custom", "loss_fn_config": {"loss_id": "x"},
                                              "forward_only": False, "data": data, "custom_loss": spec_of(handle)})
    monkeypatch.undo()
    # Each datum's scalars are 0-d in the graph, whatever the datum's length (the client's to_torch() of shape []).
    assert seen == [[(9,), (9,), (), ()], [(1,), (1,), (), ()], [(6,), (6,), (), ()]]
    client = _client_side(engine, "client", handle, data)
    assert set(server["metrics"]) == set(client["metrics"]) >= {"loss:sum", "custom/adv:mean", "custom/group:sum"}
    for k, v in client["metrics"].items():
        assert server["metrics"][k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    assert server["metrics"]["custom/group:sum"] == 2 + 3 + 4
    for (n, a), b in zip(grads(engine, "server").items(), grads(engine, "client").values()):
        assert a is not None and b is not None
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), n


def test_a_rank_0_input_of_more_than_one_element_is_refused(engine: Engine) -> None:
    vocab = engine.registry.base("tiny").vocab_size
    handle = handle_of(per_sequence, {"logprobs": 1, "old": 1, "adv": 0, "group": 0})
    create(engine, "m", seed=2)
    data = _scalar_data(vocab, seed=6)
    data[2]["loss_fn_inputs"]["adv"] = tensor_to_json(torch.zeros(6))
    with pytest.raises(UserError, match="datum 2: adv is declared rank 0 \\(a scalar\\) but has 6 elements"):
        engine.call("forward_backward", {"model_id": "m", "loss_fn": "custom", "loss_fn_config": {"loss_id": "x"},
                                         "forward_only": False, "data": data, "custom_loss": spec_of(handle)})
