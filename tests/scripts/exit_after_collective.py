"""Scripts that end right after a collective, while a DDP model keeps the process group alive.

Usage: exit_after_collective.py TRIALS
Each trial forks 2 processes that open the group through an ``Accelerator`` (gloo), prepare a DDP
model, run one backward, exchange objects with ``all_gather_object`` and end: the interpreter then
finalizes as after any script. A gloo worker still letting go of the exchange's tensors by then
aborts its process ("terminate called without an active exception", SIGABRT) unless hasten's exit
teardown waited for it. Prints one JSON line: {"trials", "aborted", "failed"} (failed: other
non-zero exit statuses). Forking from one parent that imported torch keeps a trial at the cost of
a process's finalization, not of its start.
"""

import json
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed  # noqa: F401 - DDP imports it lazily; here once, not per child
from torch import nn

from hasten import Accelerator


def starve_gloo_workers(cpu: int) -> None:
    """Put this process's gloo worker threads behind its main thread, as on a loaded machine: all
    on one CPU, the workers at SCHED_IDLE. A worker that has just finished a collective then runs
    only when the main thread sleeps or blocks, so it lets go of the collective's tensors late."""
    os.sched_setaffinity(0, {cpu})
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pt_gloo_runloop":
                os.sched_setaffinity(int(tid), {cpu})
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def one_rank(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    acc = Accelerator()
    model = acc.prepare(nn.Linear(8, 1).to(acc.device))
    acc.backward(model(torch.randn(4, 8, device=acc.device)).sum())
    if STARVE:
        starve_gloo_workers(sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))])
    out = [None, None]
    for _ in range(3):
        dist.all_gather_object(out, {"rank": rank, "values": list(range(64))})
    # the script ends here, right after its last collective


STARVE = os.environ.get("STARVE", "1") == "1"


def trial() -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                one_rank(rank, port)
            except BaseException:  # noqa: BLE001 - reported by the exit status
                import traceback

                traceback.print_exc()
                os._exit(3)
            sys.exit(0)  # a normal end: atexit handlers, then the interpreter's finalization
        pids.append(pid)
    return [os.waitpid(pid, 0)[1] for pid in pids]


def main(trials: int) -> None:
    aborted = failed = 0
    for _ in range(trials):
        statuses = trial()
        if any(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGABRT for s in statuses):
            aborted += 1
        elif any(s != 0 for s in statuses):
            failed += 1
    print(json.dumps({"trials": trials, "aborted": aborted, "failed": failed}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
