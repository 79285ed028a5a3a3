"""torch.compile together with mixed precision: the compiled model computes what the eager one
does (outputs, gradients, ``unwrap_model``), with ``TorchDynamoPlugin`` options, regional
compilation and a model compiled by the user after ``prepare``."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

from checks_api import Stack  # three repeated blocks and a head, 6 features
from hasten import Accelerator
from hasten.precision import no_autocast
from hasten.utils import TorchDynamoPlugin

pytestmark = pytest.mark.usefixtures("fresh_state")

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"rtol": 2e-2, "atol": 2e-2}  # a few bf16 roundings apart


class Net(nn.Module):
    """Returns its hidden activation too: values that survive a round trip through the low dtype
    show that the hidden layer really ran in it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        hidden = self.a(x)
        return {"hidden": hidden, "out": self.b(torch.relu(hidden))}


def _ran_in(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == torch.float32 and torch.equal(tensor, tensor.to(dtype).float())


def _twin(make, device):
    torch.manual_seed(0)
    model = make().to(device)
    reference = make().to(device)
    reference.load_state_dict(model.state_dict())
    return model, reference


def _autocast_reference(reference, x, mode):
    with torch.autocast(x.device.type, dtype=LOW[mode]):
        return reference(x)


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode,backend", [("bf16", "inductor"), ("fp16", "aot_eager")])
def test_compiled_mixed_precision_matches_eager(mode, backend):
    acc = Accelerator(mixed_precision=mode, dynamo_backend=backend)
    model, _ = _twin(Net, acc.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled, optimizer = acc.prepare(model, optimizer)  # raised in torch.compile before (getfile returned None)
    assert hasattr(compiled, "_orig_mod")
    x = torch.randn(8, 16, device=acc.device)
    out = compiled(x)
    assert _ran_in(out["hidden"], LOW[mode]) and out["out"].dtype == torch.float32
    acc.backward(out["out"].pow(2).mean())
    compiled_grads = _grads(model)
    optimizer.zero_grad()

    eager = acc.unwrap_model(compiled, keep_torch_compile=False)  # the same module, not compiled
    assert eager is model and not hasattr(eager, "_orig_mod")
    expected = eager(x)
    assert _ran_in(expected["hidden"], LOW[mode])
    acc.backward(expected["out"].pow(2).mean())
    torch.testing.assert_close(out["out"], expected["out"], **TOL)
    torch.testing.assert_close(out["hidden"], expected["hidden"], **TOL)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(compiled_grads[name], grad, **TOL, msg=name)
    assert acc.unwrap_model(compiled)._orig_mod is model  # keep_torch_compile=True keeps the wrapper
    optimizer.step()  # the step goes through (fp16: the scaler found finite gradients)
    assert not acc.optimizer_step_was_skipped


def test_the_issue_script_sequential_with_bf16_and_inductor():
    acc = Accelerator(mixed_precision="bf16", dynamo_backend="inductor")
    model, reference = _twin(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), acc.device)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    x = torch.randn(3, 8, device=acc.device)
    out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _autocast_reference(reference, x, "bf16").float(), **TOL)


def test_dynamo_plugin_options_fullgraph_and_dynamic_with_bf16():
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    plugin = TorchDynamoPlugin(backend=counting_backend, fullgraph=True, dynamic=True)
    acc = Accelerator(mixed_precision="bf16", dynamo_plugin=plugin)
    model, reference = _twin(Net, acc.device)
    compiled = acc.prepare(model)
    for rows in (3, 5, 9):  # dynamic=True: one graph for every batch size
        x = torch.randn(rows, 16, device=acc.device)
        out = compiled(x)  # fullgraph=True: a graph break would raise
        assert _ran_in(out["hidden"], torch.bfloat16) and out["out"].dtype == torch.float32
        torch.testing.assert_close(out["out"], _autocast_reference(reference, x, "bf16")["out"].float(), **TOL)
    assert len(graphs) == 1


def test_regional_compilation_with_bf16_matches_eager():
    torch._dynamo.reset()
    acc = Accelerator(mixed_precision="bf16", dynamo_plugin=TorchDynamoPlugin(backend="aot_eager",
                                                                             use_regional_compilation=True))
    model, reference = _twin(Stack, acc.device)
    prepared = acc.prepare(model)
    assert prepared is model and all(block._compiled_call_impl is not None for block in model.blocks)
    x = torch.randn(6, 6, device=acc.device)
    out = prepared(x)
    expected = _autocast_reference(reference, x, "bf16")
    assert out.dtype == torch.float32 and expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.float(), **TOL)
    out.sum().backward()
    expected.float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_regional_compilation_of_a_model_without_repeated_blocks_compiles_it_whole_with_bf16():
    acc = Accelerator(mixed_precision="bf16", dynamo_plugin=TorchDynamoPlugin(backend="aot_eager",
                                                                             use_regional_compilation=True))
    model, reference = _twin(Net, acc.device)
    compiled = acc.prepare(model)
    assert hasattr(compiled, "_orig_mod")  # no blocks to compile one by one: the whole model, as Accelerate
    x = torch.randn(4, 16, device=acc.device)
    out = compiled(x)
    assert _ran_in(out["hidden"], torch.bfloat16)
    torch.testing.assert_close(out["out"], _autocast_reference(reference, x, "bf16")["out"].float(), **TOL)


def test_a_prepared_model_compiled_by_the_user_keeps_its_autocast():
    acc = Accelerator(mixed_precision="bf16")
    model, reference = _twin(Net, acc.device)
    compiled = torch.compile(acc.prepare(model), backend="aot_eager")
    x = torch.randn(4, 16, device=acc.device)
    out = compiled(x)
    assert _ran_in(out["hidden"], torch.bfloat16) and out["out"].dtype == torch.float32
    torch.testing.assert_close(out["out"], _autocast_reference(reference, x, "bf16")["out"].float(), **TOL)
    assert not torch.is_autocast_enabled(acc.device.type)  # left behind by nobody


def test_keep_fp32_wrapper_false_stops_autocast_of_the_compiled_model_too():
    acc = Accelerator(mixed_precision="bf16", dynamo_backend="aot_eager")
    model, reference = _twin(Net, acc.device)
    compiled = acc.prepare(model)
    x = torch.randn(4, 16, device=acc.device)
    assert _ran_in(compiled(x)["hidden"], torch.bfloat16)
    plain = acc.unwrap_model(compiled, keep_fp32_wrapper=False, keep_torch_compile=False)
    assert plain is model
    expected = reference(x)
    for result in (plain(x), compiled(x)):  # as Accelerate: the model itself stops autocasting
        torch.testing.assert_close(result["out"], expected["out"], rtol=1e-5, atol=1e-6)
        assert not _ran_in(result["hidden"], torch.bfloat16)


def test_mixed_precision_leaves_forward_state_dict_and_pickling_alone():
    acc = Accelerator(mixed_precision="bf16")
    model, reference = _twin(Net, acc.device)
    prepared = acc.prepare(model)
    assert "forward" not in vars(prepared) and type(prepared) is Net  # no replaced method
    assert list(prepared.state_dict()) == list(reference.state_dict())
    x = torch.randn(4, 16, device=acc.device)
    clone = pickle.loads(pickle.dumps(prepared))  # torch.save of a whole model, multiprocessing
    out = clone(x)
    assert _ran_in(out["hidden"], torch.bfloat16) and out["out"].dtype == torch.float32
    assert acc.prepare(prepared) is prepared
    prepared(x)  # preparing twice added no second autocast (idempotent)
    assert len(prepared._forward_pre_hooks) == 1


def test_an_exception_in_forward_leaves_no_autocast_behind():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("boom")

    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(Fails())
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4, device=acc.device))
    assert not torch.is_autocast_enabled(acc.device.type)


def test_no_autocast_leaves_the_autocast_of_every_device_type_and_warns_about_nothing():
    acc = Accelerator(mixed_precision="bf16")
    a = torch.randn(4, 4, device=acc.device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a CUDA autocast made on a host without CUDA
        with acc.autocast(), torch.autocast("mps", dtype=torch.float16):  # an Apple GPU's autocast state
            with no_autocast():
                inside = a @ a
                assert not torch.is_autocast_enabled("mps")  # was left on: only cpu and cuda were disabled
            assert torch.is_autocast_enabled("mps")
            outside = a @ a
    assert inside.dtype == torch.float32 and outside.dtype == torch.bfloat16
