"""``accelerator.profile()``: torch's profiler around a block, one trace file per process.

Each process writes ``profile_<rank>.json`` (Chrome trace format, opened by Perfetto and
chrome://tracing) atomically, so a reader never sees half a trace.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .utils.dataclasses import ProfileKwargs

TRACE_NAME = "profile_{rank}.json"


@contextmanager
def profile(handler: ProfileKwargs, process_index: int, wait_for_everyone: Callable[[], None]) -> Iterator[Any]:
    """Run the block under ``handler.build()``; then write this process's trace when asked to.

    If the block raises, no trace is written and nothing waits for the other processes.
    """
    from .saving import atomic_path
    from .state import warn_once

    profiler = handler.build()
    with profiler:
        yield profiler
    if handler.output_trace_dir is None:
        return
    if getattr(profiler, "profiler", None) is None:  # a schedule that never reached an active step
        warn_once("accelerator.profile(): the schedule recorded no step, so no trace was written; "
                  "call prof.step() once per step, at least wait + warmup + active times")
    else:
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        path = os.path.join(handler.output_trace_dir, TRACE_NAME.format(rank=process_index))
        with atomic_path(path) as tmp:
            profiler.export_chrome_trace(tmp)
    wait_for_everyone()  # as in Accelerate: every trace exists once the block is left
