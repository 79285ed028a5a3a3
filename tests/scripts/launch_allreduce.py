"""Each rank all-reduces (rank + 1) over gloo and writes what it saw to OUT/rank<N>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "HASTEN_MIXED_PRECISION", "HASTEN_GRADIENT_ACCUMULATION_STEPS",
        "HASTEN_USE_CPU", "HASTEN_DEBUG", "HASTEN_DYNAMO_BACKEND", "OMP_NUM_THREADS", "HASTEN_USE_FSDP",
        "FSDP_SHARDING_STRATEGY", "TORCHELASTIC_RESTART_COUNT")
info = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(), "argv": sys.argv[2:],
        "env": {k: os.environ.get(k) for k in keys}, "main": __name__, "file": os.path.basename(__file__)}
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(info, f)
