"""Failure modes. `raise`: rank 1 raises while rank 0 waits in a gloo collective.
`raise_hang`: rank 1 raises, then hangs while exiting (a teardown that never ends); rank 0's
collective times out after 5 s, and the launcher then stops rank 1 with SIGTERM.
`kill`: no torch; rank 1 SIGKILLs itself, rank 0 sleeps (it must be stopped promptly).
`sleep`: no torch; every rank records its pid and sleeps (the test kills the launcher)."""

import os
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
if mode == "raise":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is inside the next all_reduce by now
        raise ValueError("boom from rank 1")
    dist.all_reduce(t)
elif mode == "raise_hang":
    import atexit
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        atexit.register(time.sleep, 120)  # exiting never ends: only a signal stops this process
        raise ValueError("boom from rank 1")
    dist.all_reduce(t)
elif mode == "kill":
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    time.sleep(60)
elif mode == "sleep":
    time.sleep(60)
