"""Activation checkpointing at prepare (ActivationCheckpointingKwargs, FSDP plugin flags): memory
kept for backward per mode, steps equal to the run without it, on one process here and under DDP,
FSDP2 and tensor parallelism on 2 gloo processes (checks_activation_checkpointing.py)."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from distributed import reset_state, run_checks

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"none": None, "full": {"mode": "full"}, "selective": {"mode": "selective"},
         "every_2": {"mode": "every_k", "every": 2}, "full_offload": {"mode": "full", "offload": True}}


def llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def accelerator(setting):
    from hasten import Accelerator
    from hasten.utils import ActivationCheckpointingKwargs

    reset_state()
    handlers = [ActivationCheckpointingKwargs(**setting)] if setting is not None else []
    return Accelerator(kwargs_handlers=handlers)


def one_step(setting):
    """One AdamW step of the tiny Llama prepared with ``setting``: what it kept for backward, and its numbers."""
    from hasten.activation_checkpointing import measure_saved_bytes, offload_of

    acc = accelerator(setting)
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1)).to(acc.device)
    with measure_saved_bytes(model) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    host = offload_of(model)
    return dict(saved=saved, loss=loss.detach(), grads=grads, params=model.state_dict(), host=host, model=model)


@pytest.fixture(scope="module")
def runs():
    out = {name: one_step(setting) for name, setting in MODES.items()}
    reset_state()
    return out


def test_memory_kept_for_backward_by_mode(runs):
    alive = {name: r["saved"].alive for name, r in runs.items()}
    autograd = {name: r["saved"].autograd for name, r in runs.items()}
    # Everything the forward leaves alive (a selective checkpoint keeps its matmul outputs itself).
    assert alive["full"] < alive["selective"] < alive["none"], alive
    assert alive["full"] < alive["every_2"] < alive["none"], alive
    # What autograd's saved-tensor hooks see: checkpointed blocks save only their inputs.
    assert autograd["full"] < autograd["every_2"] < autograd["none"], autograd
    assert autograd["full"] * 4 < autograd["none"], autograd


def test_offload_takes_the_checkpointed_inputs(runs):
    host = runs["full_offload"]["host"]
    assert host is not None and host.moved + host.kept > 0
    # The block inputs went through the offload hooks instead of the outer ones, byte for byte.
    assert host.moved + host.kept == runs["full"]["saved"].autograd - runs["full_offload"]["saved"].autograd
    on_device = runs["full"]["loss"].device.type != "cpu"
    assert (host.moved > 0 and host.kept == 0) if on_device else (host.moved == 0)
    assert runs["full"]["host"] is None


@pytest.mark.parametrize("mode", ["full", "selective", "every_2", "full_offload"])
def test_step_equals_the_run_without_checkpointing(runs, mode):
    ref, got = runs["none"], runs[mode]
    assert torch.equal(got["loss"], ref["loss"])
    strip = "_checkpoint_wrapped_module."
    assert {k.replace(strip, "") for k in got["grads"]} == set(ref["grads"])
    for name, grad in got["grads"].items():
        assert torch.equal(grad, ref["grads"][name.replace(strip, "")]), name
    assert set(got["params"]) == set(ref["params"])  # the state dict keeps the model's own names
    for name, value in got["params"].items():
        assert torch.equal(value, ref["params"][name]), name


def test_blocks_are_checkpointed_as_asked(runs):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    def wrapped(name):
        return [isinstance(layer, CheckpointWrapper) for layer in runs[name]["model"].model.layers]

    assert wrapped("none") == [False] * 4
    assert wrapped("full") == [True] * 4 and wrapped("selective") == [True] * 4
    assert wrapped("every_2") == [True, False, True, False]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Stack(nn.Module):
    """Repeated blocks in a ModuleList, no _no_split_modules: found through the list."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_blocks_found_in_a_module_list_and_by_class_name():
    from hasten.activation_checkpointing import find_blocks

    model = Stack()
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(model, ["Block"]) == list(model.blocks)
    acc = accelerator({"mode": "selective", "block_classes": ["Block"]})
    prepared = acc.prepare(model)
    x = torch.randn(4, 8, device=acc.device)
    prepared(x).sum().backward()
    assert all(p.grad is not None for p in prepared.parameters())


@pytest.mark.parametrize("setting, words", [
    ({"mode": "everything"}, ["mode='everything'", "'full', 'selective', 'every_k'"]),
    ({"mode": "every_k"}, ["every=None", ">= 2"]),
    ({"mode": "every_k", "every": 1}, ["every=1", "mode='full'"]),
    ({"mode": "full", "every": 3}, ["every=3", "mode='every_k'"]),
    ({"offload": "yes"}, ["offload='yes'"]),
])
def test_bad_settings_name_the_value_and_the_fix(setting, words):
    from hasten.utils import ActivationCheckpointingKwargs

    with pytest.raises(ValueError) as err:
        ActivationCheckpointingKwargs(**setting)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_model_without_blocks_is_an_error_not_a_no_op():
    acc = accelerator({"mode": "full"})
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match="no repeated blocks.*block_classes"):
        acc.prepare(model)
    acc = accelerator({"mode": "full", "block_classes": ["LlamaDecoderLayer"]})
    with pytest.raises(ValueError, match=r"block_classes=\['LlamaDecoderLayer'\] names no module class of Sequential"):
        acc.prepare(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    reset_state()


def test_fsdp_flag_and_handler_together_is_an_error():
    from hasten import Accelerator
    from hasten.utils import ActivationCheckpointingKwargs, FullyShardedDataParallelPlugin

    reset_state()
    with pytest.raises(ValueError, match="set twice"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True),
                    kwargs_handlers=[ActivationCheckpointingKwargs()])
    # The one-process group FSDP opened before the refusal is not left behind for the next Accelerator.
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="activation_checkpointing_offload=True needs activation_checkpointing=True"):
        FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing_offload=True)
    reset_state()


def test_deepspeed_is_refused_by_the_planner():
    from hasten.planning import _activation_checkpointing
    from hasten.utils import ActivationCheckpointingKwargs
    from hasten.utils.dataclasses import DistributedType

    handlers = {ActivationCheckpointingKwargs: ActivationCheckpointingKwargs()}
    with pytest.raises(ValueError, match="not supported with DeepSpeed.*gradient_checkpointing_enable"):
        _activation_checkpointing(handlers, None, DistributedType.DEEPSPEED)
    assert _activation_checkpointing(handlers, None, DistributedType.MULTI_CPU) is handlers[ActivationCheckpointingKwargs]


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_activation_checkpointing", world_size=2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2_plugin_flags", "tp"])
def test_two_processes_step_equals_the_run_without_checkpointing(two, strategy):
    for rank in two.assert_passed(f"check_{strategy}"):
        assert rank["wrapped"] > 0, rank
        for mode, worst in rank["worst"].items():
            assert worst == 0.0, (strategy, mode, worst)


def test_example_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "activation_checkpointing.py"),
                          "--mode", "selective", "--steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kept for backward" in out.stdout and "selective" in out.stdout, out.stdout
