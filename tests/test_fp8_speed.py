"""fp8 must pay or say so: the converted float8 layers are compiled when the model is not (on
CUDA by default), a model compiled through the Accelerator trains in fp8 too, and where fp8 will
not beat bf16 (a CPU, eager by choice, small layers) one warning says so."""

import warnings

import pytest
import torch
from torch import nn

from fp8_common import make_model, reference_forward, reference_model

pytest.importorskip("torchao")
pytestmark = pytest.mark.usefixtures("fresh_state")

TOL = {"rtol": 2e-2, "atol": 2e-2}


def _fp8_accelerator(cpu=True, **recipe):
    from hasten import Accelerator
    from hasten.utils import AORecipeKwargs

    return Accelerator(cpu=cpu, mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(**recipe)])


def _float8_layers(model):
    from torchao.float8.float8_linear import Float8Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def _emulation_warnings(record):
    return [w for w in record if "emulates the float8 matmuls" in str(w.message)]


def test_default_compiles_the_float8_layers_on_cuda_and_warns_once_elsewhere():
    try:
        acc = _fp8_accelerator(cpu=False)
    except ValueError as err:  # a GPU without float8 (compute capability < 8.9)
        pytest.skip(str(err))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first, second = acc.prepare(make_model()), acc.prepare(make_model(seed=1))
    compiled = [m._compiled_call_impl is not None for model in (first, second) for m in _float8_layers(model).values()]
    assert len(compiled) == 4
    if acc.device.type == "cuda":
        assert all(compiled) and not _emulation_warnings(record)
    else:  # float8 is emulated here: compiling would not make it pay; one warning, two models
        assert not any(compiled)
        assert len(_emulation_warnings(record)) == 1, [str(w.message) for w in record]
        assert "mixed_precision='bf16'" in str(_emulation_warnings(record)[0].message)


def test_auto_compile_compiles_each_float8_layer_in_place_and_matches_eager():
    acc = _fp8_accelerator(auto_compile=True)  # forced where the default is off
    model = make_model()
    keys = list(model.state_dict())
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    layers = _float8_layers(model)
    assert sorted(layers) == ["2", "4"] and all(m._compiled_call_impl is not None for m in layers.values())
    assert not hasattr(model, "_orig_mod") and list(model.state_dict()) == keys  # in place: same module, same keys
    reference = reference_model()
    x = torch.randn(8, 16, device=acc.device)
    out = model(x)
    expected = reference_forward(reference.to(acc.device), x)
    torch.testing.assert_close(out, expected, **TOL)
    acc.backward(out.pow(2).mean())
    expected.pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    optimizer.step()


def test_fp8_with_dynamo_backend_compiles_the_model_not_the_layers():
    from hasten import Accelerator
    from hasten.utils import AORecipeKwargs

    acc = Accelerator(cpu=True, mixed_precision="fp8", dynamo_backend="aot_eager",
                      kwargs_handlers=[AORecipeKwargs(auto_compile=True)])
    model = acc.prepare(make_model())  # crashed in torch.compile before (the replaced forward)
    assert hasattr(model, "_orig_mod")
    assert all(m._compiled_call_impl is None for m in _float8_layers(model).values())  # the whole model is
    x = torch.randn(8, 16, device=acc.device)
    out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference_forward(reference_model().to(acc.device), x), **TOL)


def test_opting_out_compiles_nothing_and_still_warns_on_cpu(monkeypatch):
    monkeypatch.setenv("HASTEN_FP8_AUTO_COMPILE", "false")
    acc = _fp8_accelerator()
    assert acc.fp8.auto_compile is False
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = acc.prepare(make_model())
    assert all(m._compiled_call_impl is None for m in _float8_layers(model).values())
    assert len(_emulation_warnings(record)) == 1
    monkeypatch.setenv("HASTEN_FP8_AUTO_COMPILE", "true")
    assert _fp8_accelerator().fp8.auto_compile is True
    assert _fp8_accelerator(auto_compile=False).fp8.auto_compile is False  # the recipe wins over the environment
    with pytest.raises(TypeError, match="auto_compile='yes'"):
        _fp8_accelerator(auto_compile="yes")


def test_too_small_for_float8_follows_torchaos_tables():
    from hasten.fp8 import too_small_for_float8

    def layer(in_features, out_features):
        return nn.Linear(in_features, out_features, device="meta")

    assert too_small_for_float8(layer(2048, 1024), "tensorwise")
    assert not too_small_for_float8(layer(2048, 2048), "tensorwise")
    assert not too_small_for_float8(layer(8192, 1024), "tensorwise")
    assert too_small_for_float8(layer(2048, 4096), "rowwise")
    assert not too_small_for_float8(layer(4096, 4096), "rowwise")
    assert too_small_for_float8(layer(8192, 2048), "rowwise")
