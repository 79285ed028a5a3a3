"""The one line ``hasten launch`` prints when a run ends: processes, wall time, and throughput if measured.

The processes' ``ThroughputMonitor`` (main process) writes the job's latest figures as JSON to the file
named by ``HASTEN_THROUGHPUT_SUMMARY``; the launcher reads it once the processes have exited. Torch-free.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

SUMMARY_ENV = "HASTEN_THROUGHPUT_SUMMARY"  # the launcher names the file; ThroughputMonitor writes it


def read_summary(path: str) -> Optional[dict[str, Any]]:
    """The figures a monitor wrote to ``path``; None when no monitor ran (or the file is unreadable)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _flops(value: float) -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}FLOP/s"
    return f"{value:.3g} FLOP/s"


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _bytes(value: float) -> str:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value / 2**10:.0f} KiB"


def summary_line(processes: int, wall_s: float, figures: Optional[Mapping[str, Any]]) -> str:
    """``hasten: 2 processes, wall 61.0 s; 1,234 samples/s, ..., peak memory 3.00 GiB``."""
    line = f"hasten: {processes} process{'es' if processes != 1 else ''}, wall {wall_s:.1f} s"
    if not figures:
        return line
    parts = []
    for key, unit in (("samples_per_sec", "samples/s"), ("items_per_sec", "items/s")):
        if key in figures:
            parts.append(f"{_rate(figures[key])} {unit}")
    if "flops_per_sec" in figures:
        parts.append(_flops(figures["flops_per_sec"]))
    if "mfu" in figures:
        parts.append(f"MFU {100 * figures['mfu']:.1f}%")
    if "step_time_median" in figures:
        step = f"step {_seconds(figures['step_time_median'])} median, {_seconds(figures['step_time_p90'])} p90"
        if processes > 1:
            step += f" (slowest: rank {figures['slowest_rank']})"
        parts.append(step)
    if "peak_memory_bytes" in figures:
        parts.append(f"peak memory {_bytes(figures['peak_memory_bytes'])}")
    return line + ("; " + ", ".join(parts) if parts else "")


def summary_path(folder: str, environ: Mapping[str, str]) -> tuple[str, bool]:
    """Where the processes write their figures: the user's ``HASTEN_THROUGHPUT_SUMMARY`` if set (kept after
    the run), else a file in the launcher's temporary ``folder``. Returns the path and whether it is the user's."""
    chosen = environ.get(SUMMARY_ENV)
    if chosen:
        return chosen, True
    return os.path.join(folder, "throughput.json"), False
