"""No torch: writes argv, selected environment and sys.path[0] to OUT/<RANK or single>.json."""

import json
import os
import sys

out = sys.argv[1]
name = os.environ.get("RANK", "single")
info = {"argv": sys.argv, "main": __name__, "path0": sys.path[0], "pid": os.getpid(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("HASTEN_", "FSDP_", "OMP_", "CUDA_", "RANK",
                                                                     "WORLD_SIZE", "TORCH"))}}
with open(os.path.join(out, f"{name}.json"), "w") as f:
    json.dump(info, f)
