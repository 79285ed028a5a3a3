"""Rank side of tests/test_agree_and_launch_sizes.py: saves where one process's ``os.makedirs`` (or
file write) fails, by fault injection inside that rank only. Each check returns the error every
rank raised, so the test can judge that all of them raised the same one and none was left waiting.
"""

import contextlib
import os

import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils import ProjectConfiguration

INJECTED = "injected: no space left on this process's disk"


@contextlib.contextmanager
def makedirs_fails(rank: int, fragment: str):
    """``os.makedirs`` of a path containing ``fragment`` raises on process ``rank`` only."""
    real = os.makedirs
    mine = int(os.environ["RANK"]) == rank

    def makedirs(path, *args, **kwargs):
        if mine and fragment in os.fspath(path):
            raise OSError(28, INJECTED, os.fspath(path))
        return real(path, *args, **kwargs)

    os.makedirs = makedirs
    try:
        yield
    finally:
        os.makedirs = real


def _tmp(name: str) -> str:
    return os.path.join(os.environ["HASTEN_TEST_TMP"], name)


def _user_sharded(acc: Accelerator) -> nn.Module:
    """A model the user sharded himself (FSDP2 over every process): its full weights need all-gathers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _raised(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the message is what the test compares across ranks
        return f"{type(e).__name__}: {e}"
    return "no error"


def check_save_state_folder_fails_on_rank_1_with_a_collective_hook():
    """Process 1 cannot create the checkpoint's temporary folder; a save hook gathers the full
    weights of a user-sharded model (as Accelerate users' hooks do with ``get_state_dict``)."""
    reset_state()
    acc = Accelerator(project_config=ProjectConfiguration(_tmp("hook"), automatic_checkpoint_naming=True))
    model = acc.prepare(_user_sharded(acc))
    acc.register_save_state_pre_hook(lambda models, weights, folder: acc.get_state_dict(models[0]))
    with makedirs_fails(1, ".tmp-"):
        error = _raised(acc.save_state)
    acc.wait_for_everyone()
    root = os.path.join(_tmp("hook"), "checkpoints")
    return {"error": error, "left": sorted(os.listdir(root))}


def check_save_state_node_folder_fails_on_one_node():
    """``save_on_each_node`` on two machines (one process each): process 1 cannot create its node's folder."""
    reset_state()
    acc = Accelerator(project_config=ProjectConfiguration(_tmp("nodes"), automatic_checkpoint_naming=True,
                                                          save_on_each_node=True))
    model = acc.prepare(nn.Linear(4, 2))
    assert acc.state.num_machines == 2, acc.state.num_machines
    with makedirs_fails(1, "-node1"):
        error = _raised(acc.save_state)
    acc.wait_for_everyone()
    root = os.path.join(_tmp("nodes"), "checkpoints")
    return {"error": error, "left": sorted(os.listdir(root))}


def check_save_model_of_user_sharded_model_fails_on_the_writer():
    """``save_model`` of a user-sharded model streams all-gathers; process 0 (the writer) cannot
    create the folder."""
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_user_sharded(acc))
    with makedirs_fails(0, "weights"):
        error = _raised(lambda: acc.save_model(model, _tmp("weights"), max_shard_size=300))
    acc.wait_for_everyone()
    return {"error": error}


def check_save_model_of_user_sharded_model_write_fails_midway():
    """The writer's second file cannot be written: the other processes still finish the gathers and
    every process raises."""
    import hasten.saving as saving

    reset_state()
    acc = Accelerator()
    model = acc.prepare(_user_sharded(acc))
    real, calls = saving.write_weights_into, []

    def write(target, *args):
        calls.append(target)
        if len(calls) == 2:
            raise OSError(28, INJECTED, target)
        return real(target, *args)

    saving.write_weights_into = write
    try:
        error = _raised(lambda: acc.save_model(model, _tmp("midway"), max_shard_size=300))
    finally:
        saving.write_weights_into = real
    acc.wait_for_everyone()
    # The save still works once the disk is fine again.
    acc.save_model(model, _tmp("midway"), max_shard_size=300)
    return {"error": error, "files": len(calls)}


def check_save_hooks_held_by_one_process_only():
    """Process 0 registers two save hooks, process 1 none; then process 0's second hook fails on a
    second save. The first save completes and loads; the second raises the same error everywhere."""
    reset_state()
    acc = Accelerator(project_config=ProjectConfiguration(_tmp("onehook"), automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = acc.prepare(nn.Linear(4, 2))
    calls: list = []
    fail = [False]

    def second(models, weights, folder):
        if fail[0]:
            raise OSError(28, INJECTED, folder)
        calls.append("second")

    if acc.process_index == 0:
        acc.register_save_state_pre_hook(lambda models, weights, folder: calls.append("first"))
        acc.register_save_state_pre_hook(second)
    acc.save_state()
    first_save = sorted(os.listdir(os.path.join(_tmp("onehook"), "checkpoints")))
    acc.load_state()
    fail[0] = True
    error = _raised(acc.save_state)
    acc.wait_for_everyone()
    return {"error": error, "calls": calls, "first_save": first_save,
            "left": sorted(os.listdir(os.path.join(_tmp("onehook"), "checkpoints")))}
