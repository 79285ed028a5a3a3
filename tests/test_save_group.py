"""Background saves exchange apart from training: a one-process FSDP2 save thread issues no
collective on the default group; the multi-process save group exists from the start, with the
user's timeout (issue 24 items 8 and 10)."""

import os

import pytest
import torch
from distributed import run_checks
from torch import nn

from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin


@pytest.fixture
def one_process_fsdp(fresh_state):
    """Tear down the one-process group FSDP made, so later tests in this interpreter start without one."""
    yield
    import torch.distributed as dist

    from hasten.state import PartialState

    if PartialState._shared_state and PartialState().initialized:
        PartialState().destroy_process_group()
    assert not dist.is_initialized()


def test_one_process_fsdp_background_save_issues_no_collective_on_the_training_group(one_process_fsdp, tmp_path):
    """The default group's sequence number counts every collective issued on it: a background save
    (thread included) must leave it where it was, or on CUDA the save thread drives the training's
    NCCL communicator concurrently with the training thread."""
    import torch.distributed as dist

    from hasten import Accelerator

    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 6, device=acc.device)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    world = dist.group.WORLD
    before = world._get_sequence_number_for_group()
    folder = str(tmp_path / "ckpt")
    acc.save_state(folder, blocking=False)
    acc.wait_for_checkpoint()
    assert world._get_sequence_number_for_group() == before
    assert {".metadata", "__0_0.distcp"} <= set(os.listdir(os.path.join(folder, "sharded")))
    saved = {k: v.detach().clone() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}
    acc.backward(model(torch.randn(4, 6, device=acc.device)).pow(2).mean())
    opt.step()
    acc.load_state(folder)
    after = acc.strategy.model_state_dict(model, everyone=True)
    assert all(torch.equal(saved[k], after[k]) for k in saved)


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_save_group", world_size=2)


def test_save_group_exists_before_any_save_with_the_groups_timeout(two):
    """The worker opens the group with ``PartialState(timeout=120 s)``: the gloo group background saves
    use is made then, with that timeout, not at the first save with gloo's default 30 minutes."""
    for value in two.assert_passed("check_save_group_is_made_with_the_process_group"):
        assert value == {"exists": True, "timeout": 120.0, "same_after_save": True}
