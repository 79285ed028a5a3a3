"""notebook_launcher / debug_launcher from a running interpreter (run as a script by the tests)."""

import json
import os
import sys

import torch

from hasten import debug_launcher, notebook_launcher
from hasten.launchers import LaunchError

out = sys.argv[1]
torch.randn(256, 256) @ torch.randn(256, 256)  # the parent has used its thread pool: children must cope


def train(tag, out):
    import torch.distributed as dist

    from hasten.state import PartialState

    state = PartialState()
    t = torch.tensor([float(state.process_index + 1)], device=state.device)
    dist.all_reduce(t)
    torch.randn(64, 64) @ torch.randn(64, 64)
    with open(os.path.join(out, f"{tag}{state.process_index}.json"), "w") as f:
        json.dump({"world": state.num_processes, "sum": t.item(), "pid": os.getpid(), "parent": os.getppid(),
                   "precision": os.environ.get("HASTEN_MIXED_PRECISION"), "cpu": os.environ.get("HASTEN_USE_CPU"),
                   "fork": os.environ.get("HASTEN_FORK_LAUNCHED")}, f)


def broken():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise KeyError("broken on rank 1")
    dist.barrier()


notebook_launcher(train, ("nb", out), num_processes=2, mixed_precision="bf16", use_port="0")
debug_launcher(train, ("dbg", out), num_processes=2)
try:
    debug_launcher(broken)
except LaunchError as exc:
    with open(os.path.join(out, "error.json"), "w") as f:
        json.dump({"rank": exc.rank, "message": str(exc)}, f)
print("parent pid", os.getpid(), flush=True)
