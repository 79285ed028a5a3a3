"""Accelerate's FSDP helpers (save/load_fsdp_model, save/load_fsdp_optimizer, merge_fsdp_weights) and
``hasten.commands.merge.merge_command_parser``: one process here, 2 FSDP2 processes in checks_fsdp_helpers."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from distributed import run_checks
from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.commands.merge import merge_command, merge_command_parser
from hasten.utils import (load_fsdp_model, load_fsdp_optimizer, merge_fsdp_weights, save_fsdp_model,
                          save_fsdp_optimizer)


def _trained(acc):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.randn(3, 4, device=acc.device)).sum())
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_save_and_load_in_one_process(fresh_state, tmp_path, kind):
    acc = Accelerator()
    plugin = FullyShardedDataParallelPlugin(state_dict_type=kind)  # only its state_dict_type is read here
    model, optimizer = _trained(acc)
    save_fsdp_model(plugin, acc, model, tmp_path)
    save_fsdp_optimizer(plugin, acc, optimizer, model, tmp_path)
    expected = sorted(["pytorch_model_fsdp_0", "optimizer_0"] if kind == "SHARDED_STATE_DICT"
                      else ["pytorch_model_fsdp.bin", "optimizer.bin"])
    assert sorted(os.listdir(tmp_path)) == expected

    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    other, other_opt = acc.prepare(other, other_opt)
    load_fsdp_model(plugin, acc, other, tmp_path)
    load_fsdp_optimizer(plugin, acc, other_opt, other, tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
    for got, want in zip(other_opt.optimizer.state.values(), optimizer.optimizer.state.values()):
        assert torch.equal(got["exp_avg"], want["exp_avg"]) and torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])


def test_merge_fsdp_weights_and_the_merge_parser(fresh_state, tmp_path):
    acc = Accelerator()
    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    model, _ = _trained(acc)
    save_fsdp_model(plugin, acc, model, tmp_path / "ckpt")
    source = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    want = {k: v.cpu() for k, v in model.state_dict().items()}

    merge_fsdp_weights(source, tmp_path / "out", safe_serialization=True)
    merge_fsdp_weights(source, tmp_path / "out", safe_serialization=True)  # Accelerate's script merges twice
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(merged) == sorted(want) and all(torch.equal(merged[k], want[k]) for k in want)

    merge_fsdp_weights(source, tmp_path / "bin", safe_serialization=False)
    loaded = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(loaded[k], want[k]) for k in want)

    args = merge_command_parser().parse_args([str(source), str(tmp_path / "cli"), "--unsafe_serialization"])
    assert merge_command(args) == 0
    assert os.listdir(tmp_path / "cli") == ["pytorch_model.bin"]
    with pytest.raises(ValueError, match="merge_fsdp_weights: .*pick a folder outside it"):
        merge_fsdp_weights(source, source / "inside")
    try:
        import accelerate.utils
    except ImportError:
        return
    accelerate.utils.merge_fsdp_weights(str(source), str(tmp_path / "theirs"))  # Accelerate reads our folder
    theirs = load_file(tmp_path / "theirs" / "model.safetensors")
    assert all(torch.equal(theirs[k], want[k]) for k in want)


def test_adapter_only_is_refused(fresh_state, tmp_path):
    acc = Accelerator()
    model, _ = _trained(acc)
    with pytest.raises(NotImplementedError, match=r"adapter_only=True\) is not supported"):
        save_fsdp_model(FullyShardedDataParallelPlugin(), acc, model, tmp_path, adapter_only=True)


def test_helpers_on_two_fsdp2_processes():
    report = run_checks("checks_fsdp_helpers", world_size=2)
    facts = report.assert_passed("check_save_load_merge")[0]
    assert facts == {"SHARDED_STATE_DICT": ["optimizer_0", "pytorch_model_fsdp_0"],
                     "FULL_STATE_DICT": ["optimizer.bin", "pytorch_model_fsdp.bin"]}
