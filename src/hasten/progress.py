"""What this process is doing, for ``hasten launch``'s hang watchdog and straggler check (torch-free).

hasten's hooks (a prepared dataloader fetching a batch, ``optimizer.step``, ``backward``, hasten's
collectives, ``wait_for_everyone``) update a few plain attributes of ``STATE``: no lock, no I/O,
no communication, so the hot path pays a handful of attribute writes. Under ``hasten launch`` a
heartbeat thread started by the process wrapper (``commands/_heartbeat.py``) reads them once a
second through :func:`snapshot` and leaves them where the launcher looks. Without the launcher
nothing reads them.

The straggler check compares each rank's own work per step: wall time minus the time in those
sync phases. On a CUDA device the host only queues kernels, so host time says little about who is
slow; there :class:`DeviceWorkTimer` measures the device's time between sync phases with events,
read only once the device has passed them (no host sync is added to the step).
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from contextlib import contextmanager
from datetime import timedelta
from time import perf_counter
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

LOADER = "dataloader"
BACKWARD = "backward"
OPTIMIZER = "optimizer.step"
FILE_IO = "file I/O"  # a long fsync: the watchdog does not count it as a hang

F = TypeVar("F", bound=Callable[..., Any])


class Progress:
    """Counters and the current phase of this process (read by the heartbeat thread)."""

    __slots__ = ("ticks", "steps", "batches", "where", "sync_s", "sync_since", "ddp", "hang_timeout", "device_timer",
                 "pipeline")

    def __init__(self) -> None:
        self.ticks = 0  # any progress mark: the watchdog's sign of life
        self.steps = 0  # optimizer.step() calls
        self.batches = 0  # batches handed out by prepared dataloaders
        self.where: Optional[str] = None  # hasten collective, LOADER, BACKWARD, OPTIMIZER, or None
        self.sync_s = 0.0  # seconds spent where ranks wait for each other (collectives, backward)
        self.sync_since: Optional[float] = None  # start of the sync phase under way, if any
        self.ddp = False  # a prepared model all-reduces its gradients in backward
        self.hang_timeout: Optional[float] = None  # set by the script; overrides the launcher's
        self.device_timer: Optional[DeviceWorkTimer] = None  # on CUDA: own work timed by the device
        # Inside a pipelined model's schedule step: where ("pipeline stage 1 of 2, schedule 1F1B, step 3:
        # forward of microbatch 2"), set by hasten.pipeline.model; None outside it.
        self.pipeline: Optional[str] = None


class DeviceWorkTimer:
    """The device's time spent outside sync phases, from events recorded at each phase boundary.

    ``record()`` returns an event recorded now on the device's stream, with ``query()`` (has the
    device passed it, without waiting) and ``elapsed_time(later)`` (milliseconds): on CUDA a
    ``torch.cuda.Event(enable_timing=True)``. A segment runs from the end of one sync phase to the
    start of the next; it is added to ``work_s`` once the device has passed both of its events,
    at a later phase boundary, so the total lags the device by a step or so and never waits for it.
    The device's waits for other ranks fall inside the sync phases (DDP's gradient all-reduce in
    backward, collectives), so the segments hold this rank's own work.
    """

    __slots__ = ("record", "open", "pending", "work_s")
    LIMIT = 256  # segments the device may be behind; beyond, segments go uncounted rather than pile up

    def __init__(self, record: Callable[[], Any]) -> None:
        self.record = record
        self.open: Any = None  # the event that started the current segment
        self.pending: deque = deque()  # (start, end) events of segments the device has not finished
        self.work_s = 0.0

    def sync_started(self) -> None:
        if self.open is not None and len(self.pending) < self.LIMIT:
            self.pending.append((self.open, self.record()))
        self.open = None
        self.collect()

    def sync_ended(self) -> None:
        self.collect()
        self.open = self.record()

    def collect(self) -> None:
        """Add the segments the device has finished, oldest first; never waits for the device."""
        pending = self.pending
        while pending and pending[0][1].query() and pending[0][0].query():
            start, end = pending.popleft()
            self.work_s += start.elapsed_time(end) / 1000.0


def time_device_work(record: Optional[Callable[[], Any]]) -> None:
    """Time this process's own work with device events from ``record`` (see :class:`DeviceWorkTimer`);
    ``None`` goes back to host time (the CPU, where the host does the work itself)."""
    STATE.device_timer = DeviceWorkTimer(record) if record is not None else None


# One per process, on purpose: it describes the process, and the heartbeat thread (started before the
# script imports hasten, so holding no reference) finds it through ``sys.modules`` and ``snapshot``.
STATE: Progress = Progress()


def enter(where: str) -> tuple[Optional[str], float]:
    """Mark the start of a phase where the ranks wait for each other; pass the token to :func:`leave`.

    Entering counts as progress too: a hang in the very first collective (before any step or
    batch) then starts the watchdog's clock."""
    state = STATE
    outer, start = state.where, perf_counter()
    state.where = where
    if outer is None:
        state.sync_since = start
        if state.device_timer is not None:
            state.device_timer.sync_started()
    state.ticks += 1
    return outer, start


def leave(token: tuple[Optional[str], float]) -> None:
    outer, start = token
    state = STATE
    if outer is None:  # nested phases (gather_for_metrics -> gather) are timed once
        state.sync_s += perf_counter() - start
        state.sync_since = None
        if state.device_timer is not None:
            state.device_timer.sync_ended()
    state.where = outer
    state.ticks += 1


@contextmanager
def file_io() -> Iterator[None]:
    """Mark the main thread as waiting for the disk (``fsync``): slow storage is not a hang, and the
    watchdog leaves such a process alone. Other threads (a background save) do not touch the
    training thread's phase."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state = STATE
    outer = state.where
    state.where = FILE_IO
    state.ticks += 1
    try:
        yield
    finally:
        state.where = outer
        state.ticks += 1


def collective(op: str) -> Callable[[F], F]:
    """Decorate a hasten collective so that a hang inside it is reported under its name."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            token = enter(op)
            try:
                return fn(*args, **kwargs)
            finally:
                leave(token)

        return run  # type: ignore[return-value]

    return wrap


def fetch(iterator: Any) -> Any:
    """``next(iterator)`` for a prepared dataloader, marked as data loading (StopIteration passes)."""
    state = STATE
    outer = state.where
    state.where = LOADER
    try:
        item = next(iterator)
    finally:
        state.where = outer
    state.batches += 1
    state.ticks += 1
    return item


def stepped() -> None:
    """``optimizer.step()`` returned."""
    STATE.steps += 1
    STATE.ticks += 1


def ddp_wrapped() -> None:
    """A model was wrapped in DDP: a hang inside ``backward`` is then its gradient all-reduce."""
    STATE.ddp = True


def pipeline_at(text: Optional[str]) -> None:
    """Where this process is inside a pipeline schedule step (an action started or ended: progress too);
    ``None`` once the step is over. Shown by the hang report next to the rank's position."""
    STATE.pipeline = text
    STATE.ticks += 1


def set_hang_timeout(seconds: Union[float, timedelta, None]) -> None:
    """Ask ``hasten launch`` to report a hang after ``seconds`` without progress (0 disables it).

    Overrides ``--hang_timeout`` / ``HASTEN_HANG_TIMEOUT`` for this job; ``None`` keeps the
    launcher's value. Also reachable as ``InitProcessGroupKwargs(hang_timeout=...)``.
    """
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0):
        raise ValueError(f"hang_timeout={seconds!r} must be a number of seconds >= 0 (0 turns the hang check off), "
                         "e.g. hang_timeout=600")
    STATE.hang_timeout = None if seconds is None else float(seconds)


def snapshot() -> dict[str, Any]:
    """A JSON-able copy of ``STATE`` (called by the heartbeat thread, not on the hot path)."""
    s = STATE
    now, since, timer = perf_counter(), s.sync_since, s.device_timer
    sync = s.sync_s + (now - since if since is not None else 0.0)  # a wait under way counts already
    return {"ticks": s.ticks, "steps": s.steps, "batches": s.batches, "where": s.where, "sync_s": sync,
            "t": now, "ddp": s.ddp, "hang_timeout": s.hang_timeout, "pipeline": s.pipeline,
            "work_s": timer.work_s if timer is not None else None}
