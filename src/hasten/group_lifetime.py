"""The start and the end of the process group's life, where torch leaves races that kill processes.

- ``round_store``: under torch's elastic agent with a store shared between restart rounds, the keys
  of each round under a prefix of their own (restarted processes otherwise read the dead ones'
  gloo addresses);
- ``quiesce_gloo_workers``: before the script ends, every gloo worker thread has let go of the work
  it ran (a worker still doing so after the interpreter began to finalize aborts the process);
- ``tear_down_at_exit``: the group hasten opened goes down while the interpreter still runs, and
  the process exits only once its gloo worker threads are idle (``settle_gloo_workers``);
- ``save_group``: the gloo group background saves exchange on, made with the process group.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

# Rounds of marker all-reduces at most, and the seconds one round waits for the workers to let go
# of its markers; every process runs the same number of rounds (they are collectives).
QUIESCE_ROUNDS = 50
QUIESCE_WAIT_S = 2.0


def round_store(timeout: Optional[timedelta]) -> Optional[Any]:
    """The elastic agent's store seen through a prefix of this restart round, when the agent shares
    its store with the processes (``TORCHELASTIC_USE_AGENT_STORE=True``: static rendezvous, and c10d
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, e.g. ``torchrun --max-restarts``); None otherwise.

    That store outlives the processes: after a restart it still holds the keys of the round before,
    and gloo then reads the listening addresses of the dead processes ("connectFullMesh failed ...
    Connection refused") or waits for a peer that never connects. torch adds no prefix per round, so
    each round's keys get their own here. Only when every process runs under this one agent: its
    restart count is then the same in every process, while the agents of several machines may count
    differently (a machine that joins a new round for another's failure does not count it)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None
    from torch.distributed.constants import default_pg_timeout

    client = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout or default_pg_timeout)
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hasten/restart_round_{round_}/", client)


def _gloo_threads(group: Any) -> int:
    """How many worker threads the gloo backend of ``group`` runs; 0 when it has none."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return 0
    if not isinstance(backend, getattr(dist, "ProcessGroupGloo", ())):
        return 0
    return int(getattr(backend.options, "_threads", 2) or 2)


def quiesce_gloo_workers(group: Any = None) -> bool:
    """Collective (every process of ``group`` calls it): return once every gloo worker thread of the
    group has released the work it ran; True when that was seen, False when it gave up.

    A gloo worker signals a collective complete, then drops its reference to the work. When that
    reference is the last one (a barrier keeps the works before it), the work's tensors go with it,
    and releasing a tensor Python knows takes the GIL. If the script has ended and the interpreter
    is finalizing by then, the thread is told to exit inside a C++ destructor and the process aborts
    ("terminate called without an active exception", SIGABRT) after training finished: in about 1
    of 7 runs of ``torchrun --nproc_per_node 2 examples/train.py``, the process group kept alive by
    DDP. A worker takes the next work only after letting go of the last one, so rounds of
    one-element all-reduces go on until every worker thread has been seen releasing one of them
    (each marker's release, on the worker, is noted by a weak reference): then none holds anything.
    """
    group = group or dist.group.WORLD
    threads = _gloo_threads(group) if group is not None else 0
    if threads == 0:
        return True
    seen: set[int] = set()
    lock = threading.Lock()

    def note(_: Any) -> None:
        with lock:
            seen.add(threading.get_native_id())

    here = threading.get_native_id()
    for _ in range(QUIESCE_ROUNDS):
        with lock:
            seen.discard(here)
            flag = 1.0 if len(seen) >= threads else 0.0
        # Round k's markers carry "done" as of round k-1: MIN over the processes says whether all
        # were done, so every process stops after the same round.
        markers = [torch.full((1,), flag) for _ in range(threads)]
        refs = [weakref.ref(m, note) for m in markers]
        works = [dist.all_reduce(m, op=dist.ReduceOp.MIN, group=group, async_op=True) for m in markers]
        while works:
            works.pop().wait()
        agreed = all(m.item() == 1.0 for m in markers)
        del markers  # the workers' references are then the last ones (usually)
        deadline = time.monotonic() + QUIESCE_WAIT_S
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.001)  # without the GIL: a worker releasing a marker needs it
        if agreed and all(r() is None for r in refs):
            return True
    return False


def tear_down_at_exit(world: Any) -> None:
    """The script ended with the group hasten opened still up (``torchrun``, plain ``python``): tear
    it down while the interpreter still runs (NCCL warns of a leaked communicator otherwise), then
    wait until no gloo worker thread is still letting go of the last collective's tensors.

    Destroying the group does not stop its gloo threads while something else holds it (a DDP model
    does), and a worker that drops the last reference to a tensor Python knew takes the GIL: once
    the interpreter is finalizing, that aborts the process ("terminate called without an active
    exception", SIGABRT) after the script succeeded. Registered with ``atexit`` when hasten opens
    the group; it also runs after ``hasten launch`` destroyed the group itself."""
    try:
        if dist.is_available() and dist.is_initialized() and dist.group.WORLD is world:
            release_save_group()  # its threads go now (the global teardown would leave them to finalization)
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the script's work is done either way
        pass
    settle_gloo_workers()


# The name torch gives each gloo worker thread; /proc shows it as the thread's comm.
GLOO_WORKER_NAME = "pt_gloo_runloop"
SETTLE_POLL_S = 0.005
SETTLE_QUIET_S = 0.03  # > the GIL's switch interval: a thread waiting for the GIL wakes within it
SETTLE_LIMIT_S = 3.0


def _worker_activity() -> Optional[dict[int, tuple]]:
    """(state, voluntary and involuntary context switches) of each gloo worker thread of this
    process; None where /proc cannot say (not Linux)."""
    tasks = "/proc/self/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    found: dict[int, tuple] = {}
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER_NAME:
                    continue
            with open(f"{tasks}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # the thread ended meanwhile
            continue
        found[int(tid)] = (fields.get("State", "").strip()[:1], fields.get("voluntary_ctxt_switches", "").strip(),
                           fields.get("nonvoluntary_ctxt_switches", "").strip())
    return found


def settle_gloo_workers(limit_s: float = SETTLE_LIMIT_S) -> bool:
    """Local (no collective): wait, without the GIL, until every gloo worker thread of this process
    has slept untouched for ``SETTLE_QUIET_S``; True when seen, False after ``limit_s`` or where
    /proc cannot tell.

    An idle worker sleeps on its queue's condition variable and is never woken; one that has just
    finished a collective is runnable (maybe not yet scheduled on a loaded machine) or wakes again
    and again while it waits for the GIL to release the collective's tensors. Either shows in its
    state or its context-switch counts. Unlike ``quiesce_gloo_workers`` this needs no other process,
    so it is safe at exit, whatever the other processes do. A worker blocked in a collective that
    the other processes never join looks idle too: nothing at exit could finish its work.
    """
    before = _worker_activity()
    if not before:
        return before is not None
    deadline = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)  # without the GIL: a worker waiting for it gets it now
        now = _worker_activity() or {}
        asleep = all(state in ("S", "D") for state, _, _ in now.values())
        if now != before or not asleep:
            before, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= SETTLE_QUIET_S:
            return True
    return False


_SAVE_GROUP: list = []  # [(default group, its save group)]


def _timeout_of(group: Any) -> Optional[timedelta]:
    """The timeout ``group`` was made with (the user's), or None where torch does not say."""
    try:
        return group._get_backend(group._device_types[0]).options._timeout
    except (AttributeError, IndexError, RuntimeError):
        return None


def save_group(timeout: Optional[timedelta] = None) -> Any:
    """The gloo group that background saves exchange on, apart from the training's collectives.

    Collective on first use for a process group: hasten makes it right after it opens the process
    group (every process is there), so a gloo connectivity problem of an NCCL job shows at start,
    not hours in at the first background save; a group the user opened gets it at the first
    background save. Its timeout is ``timeout``, else the process group's (the user's), not gloo's
    default 30 minutes. One per process group, shared by every ``Accelerator`` of the process (a
    script that builds them in a loop must not leak a group with its threads and sockets each
    time). None alone.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if not (_SAVE_GROUP and _SAVE_GROUP[0][0] is world):
        timeout = timeout or _timeout_of(world)
        _SAVE_GROUP[:] = [(world, dist.new_group(backend="gloo", timeout=timeout))]
    return _SAVE_GROUP[0][1]


def release_save_group() -> None:
    """Destroy the save group at the end of the script, while the interpreter still runs.

    Gloo's worker threads drop their reference to a finished collective (and so to its tensors)
    a moment after the caller has the result. If that happens once the interpreter is finalizing,
    the thread cannot take the GIL and the process aborts ("terminate called without an active
    exception"). Destroying the group now joins those threads first.
    """
    if not _SAVE_GROUP:
        return
    world, group = _SAVE_GROUP.pop()
    if dist.is_available() and dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group(group)
