"""``ThroughputMonitor``: ``Throughput`` for a training job, with figures gathered from every process.

Lightning Fabric's name. Where Lightning's monitor counts on process 0 only and multiplies by the world
size, this one asks every process: ``compute()`` is a collective (one small all-gather), so the job's
rates are true sums, a slow process is named, and the peak memory is the largest of all. Every process
must call ``compute()`` / ``compute_and_log()`` at the same points of the loop, as with any collective.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Optional, Union

from ..files.durable import atomic_write
from ..commands.run_summary import SUMMARY_ENV  # torch-free; the launcher reads what the main process writes
from .environment import get_env
from .throughput import Metrics, Throughput, Window, rates
from ..warning_kinds import HastenWarning

PEAK_ENV = "AVAILABLE_FLOPS"  # HASTEN_AVAILABLE_FLOPS (or ACCELERATE_AVAILABLE_FLOPS)

# The job's figures, in every process's compute() when more than one process runs.
JOB_KEYS = ("batches_per_sec", "samples_per_sec", "items_per_sec", "flops_per_sec", "mfu", "step_time_median",
            "step_time_p90", "slowest_rank", "peak_memory_bytes")


def peak_memory_bytes(device: Any) -> int:
    """The most memory this process has held: allocated tensors on an accelerator, resident size on CPU."""
    import torch

    device = torch.device(device)
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and hasattr(backend, "max_memory_allocated"):
        return int(backend.max_memory_allocated(device))
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def resolve_available_flops(available_flops: Optional[float], device: Any, mixed_precision: str) -> Optional[float]:
    """The peak FLOP/s of one device: the argument, else ``HASTEN_AVAILABLE_FLOPS``, else the table."""
    if available_flops is not None:
        return available_flops
    raw = get_env(PEAK_ENV)
    if raw is not None and raw.strip():
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not value > 0:
            raise ValueError(f"HASTEN_AVAILABLE_FLOPS={raw!r} is not a peak FLOP/s; set it to a positive number "
                             "such as 989.5e12 (dense FLOP/s of one device), or unset it to use hasten's table")
        return value
    from .flops import compute_dtype, get_available_flops

    return get_available_flops(device, compute_dtype(mixed_precision))


class ThroughputMonitor(Throughput):
    """Throughput of a training job: every process ``update``s with its own counts; ``compute`` gathers.

    ``compute()`` returns this process's figures (the ``device/...`` keys and totals of ``Throughput``) and,
    with several processes, the job's: ``batches_per_sec``, ``samples_per_sec``, ``items_per_sec``,
    ``flops_per_sec`` (sums over processes, once every process has a full window), ``mfu``
    (``flops_per_sec / (available_flops * processes)``), ``step_time_median`` (the slowest process's),
    ``step_time_p90`` (the largest), ``slowest_rank`` (the process with the largest median step time) and
    ``peak_memory_bytes`` (the largest). Every process gets the same job figures.

    **Collective**: with several processes, ``compute()`` and ``compute_and_log()`` exchange figures with
    every other process; call them on every process at the same steps (not under ``if is_main_process``).
    Processes that ran different numbers of steps are fine; calls at different steps raise the same
    ``RuntimeError`` on every process.

    Args:
        accelerator: the run's ``Accelerator`` (its processes, device, precision and trackers).
        available_flops: dense peak FLOP/s of one device; default: ``HASTEN_AVAILABLE_FLOPS``, else hasten's
            table for the device and the precision (``hasten.utils.peak_flops``); unknown: no MFU.
        window_size, separator: as in ``Throughput``.
    """

    def __init__(self, accelerator: Any, available_flops: Optional[float] = None, window_size: int = 100,
                 separator: str = "/") -> None:
        peak = resolve_available_flops(available_flops, accelerator.device, accelerator.mixed_precision)
        super().__init__(available_flops=peak, world_size=accelerator.num_processes, window_size=window_size,
                         separator=separator)
        if peak is None and accelerator.is_main_process:
            warnings.warn(f"ThroughputMonitor: no peak FLOP/s known for {accelerator.device}, so no MFU; pass "
                          "available_flops= or set HASTEN_AVAILABLE_FLOPS (dense FLOP/s of one device)",
                          HastenWarning, stacklevel=2)
        self._accelerator = accelerator
        self.step = -1
        self._calls = 0

    def compute(self) -> Metrics:
        """This process's figures and the job's (a collective with several processes; see the class)."""
        return self._compute(step=None)

    def compute_and_log(self, step: Optional[int] = None) -> Metrics:
        """``compute()``, then ``accelerator.log`` of the figures at ``step`` (default: one more than the last).

        A collective like ``compute()``: call it on every process; the trackers write on the processes
        they run on (the main process for most).
        """
        self.step = self.step + 1 if step is None else step
        metrics = self._compute(step=self.step)
        self._accelerator.log(metrics, step=self.step)
        return metrics

    def _compute(self, step: Optional[int]) -> Metrics:
        self._calls += 1
        window = self.window()
        metrics = self._device_metrics(window)
        memory = peak_memory_bytes(self._accelerator.device)
        metrics[self._key("peak_memory_bytes")] = memory
        summary_path = os.environ.get(SUMMARY_ENV) if self._accelerator.is_main_process else None
        if self.world_size == 1 and not summary_path:
            return metrics  # one process, no launcher to tell: the job's figures are this process's
        mine = {"call": self._calls, "step": step, "memory": memory,
                "window": None if window is None else dataclasses.asdict(window)}
        if self.world_size == 1:
            everyone = [mine]
        else:  # every process, always: no early return may skip this
            everyone = _gather_figures(mine, self._accelerator.device)
        _check_aligned(everyone)
        job = job_metrics(everyone, self.available_flops)
        if self.world_size > 1:
            metrics.update(job)
        if summary_path:
            write_summary(self.world_size, job, summary_path)
        return metrics


_WINDOW_FIELDS = tuple(field.name for field in dataclasses.fields(Window))


def _gather_figures(mine: dict, device: Any) -> list[dict]:
    """Every process's ``mine`` in rank order, through one all-gather of a small float64 tensor (None as
    NaN): a tenth of the time ``gather_object``'s pickling and two exchanges took on CPU processes."""
    import math

    import torch

    from .operations import gather

    window = mine["window"]
    values = [mine["call"], mine["step"], mine["memory"], window is not None,
              *((window[name] if window is not None else None) for name in _WINDOW_FIELDS)]
    row = torch.tensor([[math.nan if v is None else float(v) for v in values]], dtype=torch.float64, device=device)
    everyone = []
    for gathered in gather(row).cpu().tolist():
        back: list = [None if math.isnan(v) else v for v in gathered]
        call, step, memory, has_window, *fields = back
        entry = dict(zip(_WINDOW_FIELDS, fields))
        for name in ("batches", "samples", "lengths"):
            entry[name] = None if entry[name] is None else int(entry[name])
        entry["full"] = bool(entry["full"])
        everyone.append({"call": int(call), "step": None if step is None else int(step), "memory": None if memory is None else int(memory),
                         "window": entry if has_window else None})
    return everyone


def _check_aligned(everyone: list[dict]) -> None:
    """The same error on every process when the processes are not at the same call (they all hold the same list)."""
    calls = {(entry["call"], entry["step"]) for entry in everyone}
    if len(calls) > 1:
        seen = ", ".join(f"process {rank}: call {e['call']} at step {e['step']}" for rank, e in enumerate(everyone))
        raise RuntimeError(f"ThroughputMonitor.compute_and_log/compute met other processes at a different point "
                           f"({seen}); it is a collective: call it on every process, at the same steps")


def job_metrics(everyone: list[dict], available_flops: Optional[float]) -> Metrics:
    """The job's figures from every process's gathered window (same input, same result, on every process)."""
    windows = [None if e["window"] is None else Window(**e["window"]) for e in everyone]
    job: Metrics = {}
    per_process = [rates(w, None, 1) if w is not None else {} for w in windows]
    if all(per_process):  # a sum over some processes would pass for the job's: only when all have full windows
        for name in ("batches_per_sec", "samples_per_sec", "items_per_sec", "flops_per_sec"):
            if all(name in r for r in per_process):
                job[name] = sum(r[name] for r in per_process)
        if "flops_per_sec" in job and available_flops:
            job["mfu"] = job["flops_per_sec"] / (available_flops * len(everyone))
    timed = [(w.step_time_median, w.step_time_p90, rank) for rank, w in enumerate(windows)
             if w is not None and w.step_time_median is not None]
    if timed:
        median, _, slowest = max(timed)
        job.update(step_time_median=median, step_time_p90=max(p90 for _, p90, _ in timed), slowest_rank=slowest)
    job["peak_memory_bytes"] = max(e["memory"] for e in everyone)
    return job


def write_summary(processes: int, job: Metrics, path: Optional[str] = None) -> None:
    """Write the job's figures for ``hasten launch`` (atomically: the launcher may read at any moment)."""
    path = path or os.environ.get(SUMMARY_ENV)
    if not path:
        return
    summary: dict[str, Union[int, float]] = {"processes": processes, **job}
    with atomic_write(path, "w") as f:
        json.dump(summary, f)
