"""Background saves exchange apart from training: a one-process FSDP2 save thread issues no
collective on the default group; the multi-process save group exists from the start, with the
user's timeout (issue 24 items 8 and 10)."""

import os

import pytest
import torch
from distributed import run_checks
from torch import nn

from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin


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


# -- hang reports (issue 24 item 9) ---------------------------------------------------------------
@pytest.mark.parametrize("backend, nccl", [("nccl", True), ("cuda:nccl,cpu:gloo", True), ("cpu:gloo,cuda:nccl", True),
                                           ("gloo", False), ("cpu:gloo,cuda:gloo", False), ("", False)])
def test_the_flight_recorder_reader_finds_nccl_in_a_multi_backend_group(backend, nccl):
    from hasten.commands import _heartbeat

    assert _heartbeat.uses_nccl(backend) is nccl


_SIGNAL_SCRIPT = r"""
import os, signal, sys, tempfile, time
sys.path.insert(0, {src!r})
from hasten.commands import _heartbeat
calls = []
before = {before}
if before:
    signal.signal(signal.SIGUSR1, lambda *a: calls.append(1))
folder = tempfile.mkdtemp()
hb = _heartbeat.Heartbeat(folder, "0")
if not before:
    signal.signal(signal.SIGUSR1, lambda *a: calls.append(1))
hb.beat()
import json
owned = json.load(open(os.path.join(folder, "beat0.json"))).get("stack_signal")
if owned is not False:  # what the watchdog does: signal only a rank whose SIGUSR1 dumps stacks
    os.kill(os.getpid(), signal.SIGUSR1)
for _ in range(100):
    time.sleep(0.01)
hb.stacks.flush()
print(json.dumps({{"calls": len(calls), "stack": os.path.getsize(os.path.join(folder, "stack0.txt")) > 0,
                  "owned": owned}}))
"""


@pytest.mark.parametrize("before", [True, False])
def test_sigusr1_of_the_script_is_kept(before):
    """A SIGUSR1 handler the script set before the heartbeat is chained after the stack dump; one it
    sets later replaces the dump, and the heartbeat says so, so the watchdog does not signal the
    rank (a script's SIGUSR1 often means 'save and requeue')."""
    import json
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    out = subprocess.run([sys.executable, "-c", _SIGNAL_SCRIPT.format(src=src, before=before)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    value = json.loads(out.stdout.strip().splitlines()[-1])
    if before:
        assert value == {"calls": 1, "stack": True, "owned": True}
    else:
        assert value == {"calls": 0, "stack": False, "owned": False}


def test_a_rank_in_a_long_fsync_is_not_a_hang(tmp_path, monkeypatch):
    """The watchdog on hand-written heartbeats: a rank whose main thread sits in fsync (a slow disk,
    a network filesystem) past the timeout is doing I/O, and the rank waiting for it is not hung."""
    import json

    from hasten import progress
    from hasten.commands import hangs

    monkeypatch.setattr(hangs, "DUMP_WAIT_S", 0.1)

    def beat(rank, **fields):
        data = {"rank": rank, "pid": None, "ticks": 5, "changes": 1, "steps": 0, "batches": 0, "sync_s": 0.0,
                "t": 0.0, "done": False}
        data.update(fields)
        (tmp_path / f"beat{rank}.json").write_text(json.dumps(data))

    dog = hangs.Watchdog(str(tmp_path), 10.0, "test", 2, stop=lambda: None, warn=lambda _: None)
    beat(0, where=progress.FILE_IO)
    beat(1, where="gather")
    dog.check(0.0)
    assert not dog.check(5.0) and not dog.check(500.0)  # I/O is not a hang
    beat(0, where=None)  # the fsync returned and rank 0 went quiet: the clock starts again
    assert not dog.check(505.0)
    assert dog.check(511.0)


def test_fsync_marks_the_main_thread_as_in_file_io(tmp_path):
    """``fsync_fd`` on the main thread says "file I/O" while it runs and restores the phase after;
    from another thread (a background save) it leaves the training thread's phase alone."""
    import threading

    from hasten import progress
    from hasten.saving import fsync_fd

    path = tmp_path / "f"
    path.write_bytes(b"x")
    seen = []
    fd = os.open(path, os.O_RDONLY)
    try:
        progress.STATE.where = "gather"
        fsync_fd(fd, str(path))
        seen.append(progress.STATE.where)
        thread = threading.Thread(target=fsync_fd, args=(fd, str(path)))
        thread.start()
        thread.join()
        seen.append(progress.STATE.where)
    finally:
        os.close(fd)
        progress.STATE.where = None
    assert seen == ["gather", "gather"]
    assert progress.FILE_IO == "file I/O"
