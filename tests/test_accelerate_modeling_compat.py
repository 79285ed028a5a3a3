"""Big-model names and behaviour that Accelerate's own test suite (tests/test_modeling_utils.py,
test_hooks.py, test_quantization.py, test_offload.py) expects, checked on hasten's own inputs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from hasten.utils.modeling import check_device_map, get_module_size_with_ties, get_non_persistent_buffers, \
    infer_auto_device_map


# -- names that stopped Accelerate's test files at import ---------------------------------------------
def test_module_size_with_ties_finds_each_tied_module_by_its_dotted_prefix():
    # 12 layers sharing one weight: "1.weight" lives in module "1", not in "10" or "11".
    layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(12)])
    for i in range(1, 12):
        layers[i].weight = layers[0].weight
    weight, bias = 6 * 6 * 4, 6 * 4
    sizes = {"": 12 * (weight + bias), **{str(i): weight + bias for i in range(12)},
             **{f"{i}.weight": weight for i in range(12)}, **{f"{i}.bias": bias for i in range(12)}}
    to_treat = list(layers.named_children())[1:]
    tied = sorted(f"{i}.weight" for i in range(12))[1:]  # "1", "10", "11", "2", ...: sorted as strings

    total, names, modules = get_module_size_with_ties(tied, weight + bias, sizes, to_treat)

    assert total == weight + bias + 11 * bias  # each tied module adds only what it does not share
    assert names == [n.split(".")[0] for n in tied]
    assert modules == [layers[int(n)] for n in names]
    assert get_module_size_with_ties([], 5, sizes, to_treat) == (5, [], [])
    with pytest.raises(ValueError, match="none of the modules to treat"):
        get_module_size_with_ties(["99.weight"], 5, sizes, to_treat)


class _WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(2))
        self.sub = nn.Module()
        self.sub.register_buffer("mask", torch.ones(2), persistent=False)


def test_non_persistent_buffers_by_bare_or_dotted_name_without_changing_the_module():
    model = _WithMask()
    assert get_non_persistent_buffers(model) == set()
    assert get_non_persistent_buffers(model, recurse=True) == {"mask"}
    found = get_non_persistent_buffers(model, recurse=True, fqns=True)
    assert found == {"sub.mask"}
    assert found is not model.sub._non_persistent_buffers_set
    assert model._non_persistent_buffers_set == set() and model.sub._non_persistent_buffers_set == {"mask"}
    assert "scale" in model.state_dict()


def test_upcasting_layers_constant_is_what_layerwise_casting_casts_and_constants_stay_torch_free():
    from hasten.layerwise_casting import attach_layerwise_casting_hooks
    from hasten.utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING

    assert nn.Linear in SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING and nn.Conv2d in SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    attach_layerwise_casting_hooks(model, torch.float8_e4m3fn, torch.float32)
    assert model[0].weight.dtype == torch.float8_e4m3fn and model[1].weight.dtype == torch.float32
    code = "import sys, hasten.utils.constants as c; c.SAFE_WEIGHTS_NAME; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "False"


def test_bitsandbytes_module_imports_and_each_name_refuses_with_the_alternative():
    from hasten.utils import bnb
    from hasten.utils.compat import FeatureNotAvailableError
    from hasten.utils.dataclasses import BnbQuantizationConfig

    for name in ("load_and_quantize_model", "get_quantized_model_device_map", "replace_with_bnb_layers",
                 "quantize_and_offload_8bit"):
        with pytest.raises(FeatureNotAvailableError, match=rf"{name} is not available in hasten: .*torchao"):
            getattr(bnb, name)(nn.Linear(2, 2))
    with pytest.raises(FeatureNotAvailableError, match="BnbQuantizationConfig"):
        BnbQuantizationConfig(load_in_8bit=True)
    assert bnb.has_4bit_bnb_layers(nn.Linear(2, 2)) is False


# -- device-map planning ------------------------------------------------------------------------------
def _buffered_model() -> nn.Module:
    # parameters / buffers in bytes: a 48 / 40, b 40 / 80, c 60 / 40
    model = nn.Sequential(OrderedDict([("a", nn.Linear(2, 4)), ("b", nn.Linear(4, 2)), ("c", nn.Linear(4, 3))]))
    model.a.register_buffer("extra", torch.zeros(10))
    model.b.register_buffer("extra", torch.zeros(20))
    model.c.register_buffer("extra", torch.zeros(10))
    return model


def test_buffers_of_offloaded_modules_must_fit_beside_the_room_kept_for_offloaded_layers():
    model = _buffered_model()
    # GPU 0 takes "a" (88 bytes) and keeps 100 for loading the largest offloaded layer ("c");
    # the offloaded buffers (80 + 40) fit in what is left only when nothing is kept: warn.
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        device_map = infer_auto_device_map(model, max_memory={0: 300, "cpu": 10**9})
    assert device_map == {"a": 0, "b": "cpu", "c": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infer_auto_device_map(model, max_memory={0: 300, "cpu": 10**9}, offload_buffers=True)
        infer_auto_device_map(model, max_memory={0: 500, "cpu": 10**9})  # room for all: no warning


def test_a_device_left_empty_is_reported_with_the_memory_it_would_need(caplog):
    model = _buffered_model()
    with caplog.at_level(logging.INFO):
        device_map = infer_auto_device_map(model, max_memory={0: 100, "cpu": 10**9}, offload_buffers=True)
    assert set(device_map.values()) == {"cpu"}
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "insufficient memory" in message and "no module could be placed on 0" in message


def test_device_map_keys_naming_no_submodule_are_named_in_one_warning():
    model = _buffered_model()
    with pytest.warns(UserWarning, match=r"device_map keys do not match any submodules .*'nowhere', 'b\.x'"):
        check_device_map(model, {"a": "cpu", "b": "cpu", "c.weight": "cpu", "c.bias": "cpu", "c.extra": "cpu",
                                 "nowhere": "cpu", "b.x": "cpu"})


# -- offload folders written by Accelerate ------------------------------------------------------------
def test_an_offload_folder_written_by_accelerate_is_read_by_disk_offload(tmp_path):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from hasten.big_modeling import disk_offload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(torch.bfloat16)
    model.eval()
    inputs = torch.randn(3, 4, dtype=torch.bfloat16)
    expected = model(inputs)
    accelerate_utils.offload_state_dict(str(tmp_path), model.state_dict())  # one .dat per weight + index.json
    assert os.path.isfile(tmp_path / "0.weight.dat") and os.path.isfile(tmp_path / "index.json")

    fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(torch.bfloat16).eval()
    disk_offload(fresh, str(tmp_path), execution_device=inputs.device, offload_buffers=True)
    assert fresh[0].weight.device.type == "meta"
    assert torch.equal(fresh(inputs), expected)


# -- checkpoints in the shapes Accelerate reads -------------------------------------------------------
def _write_bare_index_checkpoint(model: nn.Module, folder: str, index_name: str) -> None:
    """Shards per top-level module and an index that is only ``{tensor name: shard file}``."""
    import json

    index = {name: f"part-{name.split('.')[0]}.bin" for name in model.state_dict()}
    for shard in set(index.values()):
        torch.save({k: v for k, v in model.state_dict().items() if index[k] == shard}, os.path.join(folder, shard))
    with open(os.path.join(folder, index_name), "w") as f:
        json.dump(index, f)


def test_a_bare_index_of_any_name_loads_by_file_and_by_folder(tmp_path):
    from hasten.utils.modeling import load_checkpoint_in_model

    source = _buffered_model()
    _write_bare_index_checkpoint(source, str(tmp_path), "weights.index.json")
    for checkpoint in (tmp_path / "weights.index.json", tmp_path):
        target = _buffered_model()
        nn.init.zeros_(target.a.weight)
        load_checkpoint_in_model(target, str(checkpoint))
        for name, tensor in source.state_dict().items():
            assert torch.equal(target.state_dict()[name], tensor), (checkpoint, name)
    _write_bare_index_checkpoint(source, str(tmp_path), "other.index.json")
    with pytest.raises(ValueError, match="several indexes"):
        load_checkpoint_in_model(_buffered_model(), str(tmp_path))
