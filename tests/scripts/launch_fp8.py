"""Trains a tiny model with whatever fp8 settings `hasten launch` passed; writes OUT/rank<R>.json."""

import json
import os
import sys

import torch

from hasten import Accelerator

out = sys.argv[1]
acc = Accelerator()  # mixed precision, backend and recipe settings come from the launcher
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
x = torch.randn(8, 16, generator=torch.Generator().manual_seed(acc.process_index))
for _ in range(2):
    acc.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()
inner = acc.unwrap_model(model)
full = acc.get_state_dict(model)  # under FSDP2: on process 0 only
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"precision": acc.mixed_precision, "backend": str(acc.fp8_backend.value),
               "pad_inner_dim": acc.fp8.config.pad_inner_dim, "distributed_type": str(acc.distributed_type.value),
               "layers": [type(m).__name__ for m in inner if "Linear" in type(m).__name__],
               "float8_all_gather": [type(getattr(p, "_local_tensor", p)).__name__ for p in inner[2].parameters()],
               "weight_sum": float(full["2.weight"].sum()) if full else None}, f)
