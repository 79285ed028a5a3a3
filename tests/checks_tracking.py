"""Trackers on 2 processes (run inside every rank; see distributed.py and test_tracking_distributed.py)."""

import os
import time

from hasten import Accelerator
from hasten.tracking import GeneralTracker


def _offline(root):
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=root, WANDB_SILENT="true")


def check_only_main_creates_runs():
    root = os.environ["TRACK_DIR"]
    _offline(root)
    acc = Accelerator(log_with=["tensorboard", "wandb"], project_dir=os.path.join(root, "runs"))
    acc.init_trackers("two", config={"world": acc.num_processes})
    rank = acc.process_index
    for step in range(3):
        acc.log({"loss": 100.0 * rank + step}, step=step)
    started = time.perf_counter()
    if rank == 1:  # unequal work: only rank 1 logs more; nothing may wait for rank 0
        for step in range(3, 500):
            acc.log({"loss": 100.0 + step}, step=step)
    log_seconds = time.perf_counter() - started
    unwrapped = acc.get_tracker("wandb", unwrap=True)
    if rank == 1:
        unwrapped.log({"loss": -1.0})  # a no-op off the main process, no guard needed
    running = [t.name for t in acc._running_trackers]
    acc.free_memory()  # finishes the runs
    return {"running": running, "unwrapped": type(unwrapped).__name__, "log_seconds": log_seconds}


class EveryProcess(GeneralTracker):
    name = "every"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self):
        super().__init__()
        self.events = []

    @property
    def tracker(self):
        return self.events

    def start(self):
        self.events.append("start")

    def log(self, values, step=None, **kwargs):
        self.events.append(f"log {values['rank']}")

    def finish(self):
        self.events.append("finish")


def check_tracker_for_every_process():
    tracker = EveryProcess()
    acc = Accelerator(log_with=tracker)
    acc.init_trackers("p")
    acc.log({"rank": acc.process_index})
    acc.free_memory()
    return tracker.events
