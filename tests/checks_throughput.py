"""ThroughputMonitor on 2 real processes (run inside every rank; see distributed.py and test_throughput.py).

Times are injected (``update(time=...)``), so the figures are exact and a slow rank is slow on purpose.
"""

import json
import os

from hasten import Accelerator
from hasten.tracking import GeneralTracker
from hasten.utils import ThroughputMonitor

PEAK = 1e9  # FLOP/s of one device, passed in: the test machines' CPUs are in no table
FLOPS = 6000  # FLOPs of one batch


def _feed(monitor, steps: int, step_time: float, batch: int = 2, tokens: int = 5) -> None:
    for i in range(1, steps + 1):
        monitor.update(time=i * step_time, batches=i, samples=i * batch, lengths=i * batch * tokens,
                       flops_per_batch=FLOPS)


def check_world_figures_and_slowest_rank():
    acc = Accelerator()
    monitor = ThroughputMonitor(acc, available_flops=PEAK, window_size=3)
    _feed(monitor, 4, step_time=0.1 if acc.process_index == 0 else 0.4)  # rank 1 is 4x slower
    return monitor.compute()


def check_unequal_ranks_do_not_hang():
    """Rank 1 has no step at the first compute and a window not yet full at the second: both ranks still
    meet in the same gathers and agree on the job's figures."""
    acc = Accelerator()
    monitor = ThroughputMonitor(acc, available_flops=PEAK, window_size=3)
    if acc.process_index == 0:
        _feed(monitor, 5, step_time=0.1)
    first = monitor.compute()
    if acc.process_index == 1:
        _feed(monitor, 2, step_time=0.2)
    second = monitor.compute()
    return [first, second]


def check_misaligned_calls_raise_on_every_rank():
    acc = Accelerator()
    monitor = ThroughputMonitor(acc, available_flops=PEAK, window_size=2)
    _feed(monitor, 2, step_time=0.1)
    try:
        monitor.compute_and_log(step=10 + acc.process_index)
    except RuntimeError as error:
        return str(error)
    raise AssertionError("compute_and_log at different steps on the processes did not raise")


class Recorder(GeneralTracker):
    """A tracker that keeps what it is given (the main process's only)."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.logged = []

    @property
    def tracker(self):
        return self.logged

    def log(self, values, step=None, **kwargs):
        self.logged.append({"step": step, "values": dict(values)})


def check_log_to_tracker_and_summary_file():
    recorder = Recorder()
    acc = Accelerator(log_with=recorder)
    acc.init_trackers("throughput")
    monitor = ThroughputMonitor(acc, available_flops=PEAK, window_size=3)
    _feed(monitor, 4, step_time=0.1 if acc.process_index == 0 else 0.2)
    returned = monitor.compute_and_log(step=7)
    summary = None
    if acc.is_main_process:  # written by the main process inside compute_and_log
        with open(os.environ["HASTEN_THROUGHPUT_SUMMARY"]) as f:
            summary = json.load(f)
    acc.end_training()
    return {"logged": recorder.logged, "returned": returned, "summary": summary}
