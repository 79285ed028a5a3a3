"""FSDP2 asked for on one process is applied (DTensor parameters, offload, DCP checkpoints), in this
process and under ``hasten launch --num_processes 1``; the process-group backend chosen for FSDP."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

FEATURES = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def _batches(device, count=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        x = torch.randn(4, FEATURES, generator=g)
        out.append((x.to(device), x.sum(1, keepdim=True).sin().to(device)))
    return out


def _full(acc, model) -> dict:
    return {k: v.detach().clone().cpu() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}


def _step(acc, model, opt, x, y, clip=0.5):
    loss = nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    norm = acc.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return float(loss.detach()), float(norm)


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp_on_one_process_shards_offloads_and_trains_like_plain_training(one_process_fsdp, offload):
    from hasten import Accelerator
    from hasten.utils import DistributedType

    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, cpu_offload=offload))
    assert acc.distributed_type == DistributedType.FSDP
    assert (acc.num_processes, acc.use_distributed, type(acc.strategy).__name__) == (1, False, "FSDP2Strategy")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    assert all(p.device_mesh.mesh_dim_names == ("dp_shard",) and p.device_mesh.size() == 1 for p in model.parameters())
    # Offload keeps the sharded parameters in host memory; without it they live on the accelerator's device.
    home = torch.device("cpu") if offload else acc.device
    assert all(p.to_local().device.type == home.type for p in model.parameters())

    ref = _model().to(acc.device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in _batches(acc.device):
        loss, norm = _step(acc, model, opt, x, y)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss - float(ref_loss.detach())) < 1e-6 and abs(norm - ref_norm) < 1e-6
    got, want = _full(acc, model), {k: v.cpu() for k, v in ref.state_dict().items()}
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6


def test_fsdp_on_one_process_checkpoint_is_sharded_dcp_and_restores_exactly(one_process_fsdp, tmp_path):
    from hasten import Accelerator

    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, cpu_offload=True))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    batches = _batches(acc.device, 4)
    _step(acc, model, opt, *batches[0])
    folder = str(tmp_path / "ckpt")
    acc.save_state(folder)
    saved = _full(acc, model)
    after_saved = [_step(acc, model, opt, *b) for b in batches[1:]]
    names = sorted(os.listdir(folder))
    assert "sharded" in names and not any(n.endswith(".safetensors") and n.startswith("model") for n in names), names
    assert {".metadata", "__0_0.distcp"} <= set(os.listdir(os.path.join(folder, "sharded")))
    with open(os.path.join(folder, "manifest.json")) as f:
        layout = json.load(f)["layout"]
    assert layout == {"strategy": "FSDP2Strategy", "state_dict": "dcp",
                      "mesh": {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}}

    acc.load_state(folder, continue_dataloaders=True)
    assert all(torch.equal(saved[k], v) for k, v in _full(acc, model).items())
    again = [_step(acc, model, opt, *b) for b in batches[1:]]
    assert again == after_saved  # Adam moments came back exactly too


def test_hasten_launch_one_process_use_fsdp_with_offload(tmp_path):
    """The user's command: ``hasten launch --num_processes 1 --use_fsdp --fsdp_version 2
    --fsdp_offload_params true script.py`` (``--cpu`` here: this suite also runs without a GPU)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "from torch import nn\n"
        "from hasten import Accelerator\n"
        "acc = Accelerator()\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, opt = acc.prepare(model, opt)\n"
        "x = torch.randn(3, 4, device=acc.device)\n"
        "acc.backward(model(x).pow(2).mean())\n"
        "acc.clip_grad_norm_(model.parameters(), 1.0)\n"
        "opt.step()\n"
        "acc.save_state(sys.argv[1])\n"
        "acc.end_training()\n"
        "print('FACTS', json.dumps({'type': str(acc.distributed_type), 'n': acc.num_processes,\n"
        "    'dtensor': all(type(p).__name__ == 'DTensor' for p in model.parameters()),\n"
        "    'local': sorted({p.to_local().device.type for p in model.parameters()}),\n"
        "    'offload': acc.strategy.plugin.cpu_offload,\n"
        "    'files': sorted(os.listdir(os.path.join(sys.argv[1], 'sharded')))}))\n"
    )
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", "--num_processes", "1", "--use_fsdp",
                          "--fsdp_version", "2", "--fsdp_offload_params", "true", "--cpu", str(script),
                          str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.split("FACTS", 1)[1])
    assert facts == {"type": "FSDP", "n": 1, "dtensor": True, "local": ["cpu"], "offload": True,
                     "files": [".metadata", "__0_0.distcp"]}, facts


# -- the process-group backend --------------------------------------------------------------------------
@pytest.mark.parametrize("device, offload, expected", [
    ("cpu", False, "gloo"), ("cpu", True, "gloo"),
    ("cuda", False, "nccl"), ("cuda", True, "cuda:nccl,cpu:gloo"),
    ("xpu", False, "xccl"), ("xpu", True, "xpu:xccl,cpu:gloo"),
    ("mps", True, "gloo"),
])
def test_backend_for_fsdp_cpu_offload_adds_gloo_for_cpu_tensors(device, offload, expected):
    """FSDP2's CPU offload all-reduces and all-gathers CPU tensors (clip_grad_norm_'s total, full_tensor() of
    CPU shards, broadcasts of rank 0's weights): an accelerator's group needs a CPU backend beside it."""
    from hasten.device_choice import choose_backend

    assert choose_backend(device, cpu_offload=offload) == expected


@pytest.mark.parametrize("backend, serves", [
    ("gloo", True), ("nccl", False), ("cuda:nccl,cpu:gloo", True), ("xpu:xccl,cpu:gloo", True), ("xccl", False),
    ("cpu:gloo,cuda:gloo", True), ("cuda:nccl", False),  # get_backend_config() spellings
])
def test_backend_serves_cpu_tensors(backend, serves):
    from hasten.device_choice import serves_cpu_tensors

    assert serves_cpu_tensors(backend) is serves


def test_fsdp_with_cpu_offload_on_a_group_without_cpu_backend_is_named():
    from hasten.strategies.fsdp2 import check_offload_backend

    check_offload_backend("cuda", "cuda:nccl,cpu:gloo")
    check_offload_backend("cpu", "gloo")
    with pytest.raises(ValueError, match="backend 'nccl'.*cuda:nccl,cpu:gloo"):
        check_offload_backend("cuda", "nccl")


def test_fsdp_on_one_process_after_partial_state_with_process_group_kwargs(one_process_fsdp):
    """PartialState() first (no plugin yet), then the Accelerator with FSDP and InitProcessGroupKwargs:
    the one-process group is opened then, with the backend and timeout given."""
    from datetime import timedelta

    import torch.distributed as dist

    from hasten import Accelerator
    from hasten.device_choice import choose_backend
    from hasten.state import PartialState
    from hasten.utils import InitProcessGroupKwargs

    state = PartialState()
    assert not dist.is_initialized()
    backend = choose_backend(state.device.type)
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2),
                      kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=60))])
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == backend
    model = acc.prepare(_model())
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    acc.end_training()
    assert not dist.is_initialized()


def test_offload_is_read_from_bools_and_torch_policies():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from hasten.utils.fsdp_plugin import offloads_to_cpu

    assert [offloads_to_cpu(v) for v in (True, False, None, CPUOffloadPolicy(pin_memory=False), OffloadPolicy())] == \
        [True, False, False, True, False]
