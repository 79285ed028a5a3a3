"""Trackers on 2 real processes: only rank 0 creates runs and writes; other ranks never wait.

(mlflow goes through the same code path; it is read back in test_tracking.py, where its
store is created once.)"""

import glob
import os

import pytest

import tracker_readers as read
from distributed import run_checks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("track"))
    return run_checks("checks_tracking", world_size=2, env={"TRACK_DIR": root}), root


def test_only_rank_zero_creates_runs(two_ranks):
    report, root = two_ranks
    main, other = report.assert_passed("check_only_main_creates_runs")
    assert main["running"] == ["tensorboard", "wandb"] and main["unwrapped"] != "InertRun"
    assert other["running"] == [] and other["unwrapped"] == "InertRun"
    assert other["log_seconds"] < 5, other  # 497 calls that do nothing
    assert len(glob.glob(os.path.join(root, "runs", "two", "events.out.tfevents.*"))) == 1
    assert read.tensorboard_scalars(os.path.join(root, "runs", "two"))["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    (wandb_run,) = read.wandb_offline_runs(root)
    assert read.wandb_history(wandb_run)["loss"] == [(0, 0), (1, 1), (2, 2)]


def test_tracker_that_asks_for_every_process(two_ranks):
    report, _ = two_ranks
    assert report.assert_passed("check_tracker_for_every_process") == [
        ["start", "log 0", "finish"], ["start", "log 1", "finish"]]
