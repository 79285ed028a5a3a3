"""Resuming the way transformers' ``run_*_no_trainer.py`` scripts do is exact.

The scripts resume with ``load_state(checkpoint)`` and then run the interrupted epoch through
``accelerator.skip_first_batches(train_dataloader, n)``. Under Accelerate that pass shuffles anew (the
restored global generator draws a new seed), so the resumed run sees other samples than the
uninterrupted run did and every later random draw (dropout) moves: the weights differ (by up to
3e-3 on the clm stand-in, identically under Accelerate). hasten's ``load_state`` knows where the
epoch was and which seed it drew, so ``skip_first_batches(loader, n)`` at that position replays the
interrupted epoch: same samples, same generator, the same weights as never having stopped.
tests/scripts/no_trainer_resume.py is the pattern in small (model with dropout, shuffled loader).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "no_trainer_resume.py")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import no_trainer_harness as harness  # noqa: E402


def run(processes: int, *args: str) -> dict:
    """Run the script; returns {(rank, step): record}."""
    done = subprocess.run(harness.launcher("hasten", processes) + [SCRIPT, *args], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {(r["rank"], r["step"]): r for r in records}


@pytest.mark.parametrize("processes", [1, 2])
def test_a_resume_through_skip_first_batches_replays_the_interrupted_epoch(tmp_path, processes):
    whole_dir, resumed_dir = str(tmp_path / "whole"), str(tmp_path / "resumed")
    os.makedirs(resumed_dir)
    whole = run(processes, whole_dir)
    resumed = run(processes, resumed_dir, os.path.join(whole_dir, "step_2"))
    # Every step after the checkpoint: the same samples on each rank, the same generator state.
    assert sorted(resumed) == [key for key in sorted(whole) if key[1] > 2]
    for key, record in resumed.items():
        assert record == whole[key], (key, record, whole[key])
    a = torch.load(os.path.join(whole_dir, "weights.pt"))
    b = torch.load(os.path.join(resumed_dir, "weights.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a)
