"""Rank 1 fails on the first attempt; on the restart every rank all-reduces and writes a file."""

import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
rank = dist.get_rank()
if attempt == 0 and rank == 1:
    raise RuntimeError("fail on the first attempt")
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "attempt": attempt, "sum": t.item()}, f)
