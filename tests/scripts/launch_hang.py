"""Hangs and stragglers under `hasten launch` (2 CPU processes). Usage: launch_hang.py MODE OUT

`skip`: rank 1 skips a gather (as under `if accelerator.is_main_process:`) and goes on to
wait_for_everyone, while rank 0 waits in the gather. `loader`: rank 1's dataset sleeps forever in
__getitem__ at batch 3 while rank 0 goes on to backward (DDP's all-reduce); the script sets its own
hang timeout (8 s). `straggler`: rank 1 sleeps 0.3 s per step. `normal`: a healthy run that starts
slowly (8 s before hasten is used, like a slow `import torch`). Each rank writes OUT/rank<r>.json
when done, and OUT/hang<r> with the time (time.monotonic) just before it starts hanging.
"""

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from hasten import Accelerator
from hasten.utils import InitProcessGroupKwargs

mode, out = sys.argv[1], sys.argv[2]


def hanging_now():
    with open(os.path.join(out, f"hang{os.environ['RANK']}"), "w") as f:
        f.write(repr(time.monotonic()))


class Data(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        if mode == "loader" and int(os.environ["RANK"]) == 1 and i >= 3 * 8 * 2:
            hanging_now()
            time.sleep(3600)  # stuck reading a file, say
        return torch.full((4,), float(i % 7)), torch.ones(1)


if mode == "normal":
    time.sleep(8)
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(hang_timeout=8 if mode == "loader" else None)])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = {"skip": 6, "loader": 100, "straggler": 60, "normal": 30}[mode]
model, opt, dl = accelerator.prepare(model, opt, DataLoader(Data(), batch_size=8))
rank = accelerator.process_index
for step, (x, y) in enumerate(dl):
    if step == steps:
        break
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    if mode == "skip" and step == 3:
        hanging_now()
        if rank == 0:
            accelerator.gather(loss.detach().reshape(1, 1).expand(2, 3).contiguous())
        accelerator.wait_for_everyone()
    if mode == "straggler" and rank == 1:
        time.sleep(0.3)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"steps": step}, f)
