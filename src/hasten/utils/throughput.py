"""``Throughput``: samples, items (tokens), FLOPs and step times per second over a window of recent steps.

Lightning Fabric's name and semantics. Nothing here talks to other processes: figures for the whole
job are *extrapolated* from this process (``world_size`` times its own), as Lightning does. For figures
*gathered* from every process (true sums, the slowest process named) use ``ThroughputMonitor``.
Torch-free: the caller measures the time (after a device synchronisation; see ``update``).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Optional, Union

Metrics = dict[str, Union[int, float]]


@dataclass(frozen=True)
class _Record:
    time: float
    batches: int
    samples: int
    lengths: Optional[int]
    flops: Optional[float]  # FLOPs of all batches up to this record (a running total: a window is a difference)


@dataclass(frozen=True)
class Window:
    """What one process did over its window: the numbers the rates are made of (JSON-able)."""

    full: bool
    elapsed: float
    batches: int
    samples: int
    lengths: Optional[int]
    flops: Optional[float]
    step_time_median: Optional[float]
    step_time_p90: Optional[float]


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values``, interpolated linearly between neighbours (numpy's default)."""
    return _sorted_percentile(sorted(values), fraction)


def _sorted_percentile(ordered: list[float], fraction: float) -> float:
    """``percentile`` of values already in ascending order (one sort serves several quantiles)."""
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Throughput:
    """Rates over the ``window_size`` most recent ``update`` calls of this process.

    ``compute()`` returns the totals ``time``, ``batches``, ``samples`` (and ``lengths``), as soon as one
    update was made; ``device/step_time_median`` and ``device/step_time_p90`` (seconds per batch) from two;
    and once the window is full, ``device/batches_per_sec``, ``device/samples_per_sec``,
    ``device/items_per_sec`` (with ``lengths``), ``device/flops_per_sec`` (with ``flops_per_batch``) and
    ``device/mfu`` (with ``available_flops``). With ``world_size > 1`` it adds ``batches_per_sec``,
    ``samples_per_sec``, ``items_per_sec``, ``flops_per_sec`` and ``mfu`` for the job: this process's
    rates times ``world_size`` (``mfu``: ``flops_per_sec / (available_flops * world_size)``).

    Args:
        available_flops: dense peak FLOP/s of one device (see ``hasten.utils.peak_flops``); None: no MFU.
        world_size: number of processes, for the job's figures.
        window_size: number of updates the rates are computed over (at least 2: a rate needs two times).
        separator: between ``device`` and the name in the per-device keys.
    """

    def __init__(self, available_flops: Optional[float] = None, world_size: int = 1, window_size: int = 100,
                 separator: str = "/") -> None:
        if not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"window_size={window_size!r}: a rate needs at least two updates; pass an int >= 2")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: pass the number of processes (an int >= 1)")
        if available_flops is not None and not available_flops > 0:
            raise ValueError(f"available_flops={available_flops!r}: pass the peak FLOP/s of one device "
                             "(a positive number, e.g. 989.5e12 for an H100 SXM in bfloat16), or None")
        self.available_flops = available_flops
        self.world_size = world_size
        self.window_size = window_size
        self.separator = separator
        self._records: deque[_Record] = deque(maxlen=window_size)
        # The step times between consecutive records, in ascending order, so that a compute() reads its
        # quantiles without sorting the window again (one bisect per update instead).
        self._sorted_steps: list[float] = []

    def update(self, *, time: float, batches: int, samples: int, lengths: Optional[int] = None,
               flops: Optional[float] = None, flops_per_batch: Optional[float] = None) -> None:
        """Record where this process is now.

        Args:
            time: seconds since any fixed start; must grow with every call. On an accelerator, read the
                clock after something waits for the device (``loss.item()``, ``torch.cuda.synchronize()``),
                or it measures how fast work is queued, not done.
            batches: batches this process has run so far (grows with every call).
            samples: samples this process has run so far (grows with every call).
            lengths: items (e.g. tokens, padding included) this process has run so far; on every call or none.
            flops: FLOPs this process ran since the previous call (Lightning's meaning: ``measure_flops``
                times the batches run since then). On every call or none.
            flops_per_batch: instead of ``flops``: FLOPs of one batch on this process (``measure_flops``),
                counted once per batch run since the previous call.
        """
        if flops is not None and flops_per_batch is not None:
            raise ValueError("update(): pass flops (FLOPs since the previous update) or flops_per_batch (FLOPs of one "
                             "batch), not both")
        last = self._records[-1] if self._records else None
        if last is not None:
            for name, now, before in (("time", time, last.time), ("batches", batches, last.batches),
                                      ("samples", samples, last.samples)):
                if not now > before:
                    raise ValueError(f"update({name}={now!r}): {name} must grow with every update (the previous "
                                     f"was {before!r}); pass running totals, not per-step values")
            given = ("flops", flops) if flops_per_batch is None else ("flops_per_batch", flops_per_batch)
            for name, now, before in (("lengths", lengths, last.lengths), (*given, last.flops)):
                if (now is None) != (before is None):
                    raise ValueError(f"update({name}={now!r}): pass {name} on every update or on none "
                                     f"(the previous update {'had' if before is not None else 'had no'} {name})")
        if flops_per_batch is not None:
            flops = float(flops_per_batch) * (batches - last.batches if last is not None else batches)
        elif flops is not None:
            flops = float(flops)
        if flops is not None and last is not None:
            flops += last.flops  # the running total
        record = _Record(float(time), int(batches), int(samples), lengths, flops)
        if last is not None:
            if len(self._records) == self.window_size:  # the oldest record, and the step after it, leave
                _bisect_remove(self._sorted_steps, _step_time(self._records[0], self._records[1]))
            bisect.insort(self._sorted_steps, _step_time(last, record))
        self._records.append(record)

    def window(self) -> Optional[Window]:
        """The raw numbers of the current window, or None before the first update."""
        if not self._records:
            return None
        first, last = self._records[0], self._records[-1]
        steps = self._sorted_steps
        return Window(
            full=len(self._records) == self.window_size,
            elapsed=last.time - first.time,
            batches=last.batches - first.batches,
            samples=last.samples - first.samples,
            lengths=None if last.lengths is None else last.lengths - first.lengths,
            flops=None if last.flops is None else last.flops - first.flops,  # work after the first time
            step_time_median=_sorted_percentile(steps, 0.5) if steps else None,
            step_time_p90=_sorted_percentile(steps, 0.9) if steps else None,
        )

    def compute(self) -> Metrics:
        """This process's figures and, with ``world_size > 1``, the job's extrapolated ones (see the class)."""
        metrics = self._device_metrics(self.window())
        if self.world_size > 1 and metrics:
            metrics.update(self._extrapolated(metrics))
        return metrics

    def _key(self, name: str) -> str:
        return f"device{self.separator}{name}"

    def _device_metrics(self, window: Optional[Window]) -> Metrics:
        """This process's figures from ``window`` (``self.window()``, made once by the caller)."""
        if window is None:
            return {}
        last = self._records[-1]
        metrics: Metrics = {"time": last.time, "batches": last.batches, "samples": last.samples}
        if last.lengths is not None:
            metrics["lengths"] = last.lengths
        if window.step_time_median is not None:
            metrics[self._key("step_time_median")] = window.step_time_median
            metrics[self._key("step_time_p90")] = window.step_time_p90
        metrics.update({self._key(k): v for k, v in rates(window, self.available_flops, 1).items()})
        return metrics

    def _extrapolated(self, metrics: Metrics) -> Metrics:
        prefix = self._key("")
        job = {k[len(prefix):]: v * self.world_size for k, v in metrics.items()
               if k.startswith(prefix) and k.endswith("_per_sec")}
        if "flops_per_sec" in job and self.available_flops:
            job["mfu"] = job["flops_per_sec"] / (self.available_flops * self.world_size)
        return job

    def reset(self) -> None:
        """Forget every update (e.g. after a pause that should not count, such as evaluation)."""
        self._records.clear()
        self._sorted_steps.clear()


def _step_time(before: _Record, after: _Record) -> float:
    """Seconds per batch between two consecutive records (the same value every time it is computed)."""
    return (after.time - before.time) / (after.batches - before.batches)


def _bisect_remove(ordered: list[float], value: float) -> None:
    """Remove one ``value`` from the ascending list ``ordered`` (it is there: it was inserted with insort)."""
    del ordered[bisect.bisect_left(ordered, value)]


def rates(window: Window, available_flops: Optional[float], devices: int) -> Metrics:
    """Per-second figures of a full window (none of a window not yet full); ``mfu`` against ``devices`` peaks."""
    if not window.full:
        return {}
    out: Metrics = {"batches_per_sec": window.batches / window.elapsed,
                    "samples_per_sec": window.samples / window.elapsed}
    if window.lengths is not None:
        out["items_per_sec"] = window.lengths / window.elapsed
    if window.flops is not None:
        out["flops_per_sec"] = window.flops / window.elapsed
        if available_flops:
            out["mfu"] = out["flops_per_sec"] / (available_flops * devices)
    return out
