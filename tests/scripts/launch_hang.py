"""Hangs and stragglers under `hasten launch` (2 CPU processes). Usage: launch_hang.py MODE OUT

`skip`: rank 1 skips a gather (as under `if accelerator.is_main_process:`) and goes on to
wait_for_everyone, while rank 0 waits in the gather. `loader`: rank 1's dataset sleeps forever in
__getitem__ at batch 3 while rank 0 goes on to backward (DDP's all-reduce). `straggler`: rank 1
sleeps 0.3 s per step. `normal`: a short healthy run. Each rank writes OUT/rank<r>.json when done.
"""

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from hasten import Accelerator

mode, out = sys.argv[1], sys.argv[2]


class Data(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        if mode == "loader" and int(os.environ["RANK"]) == 1 and i >= 3 * 8 * 2:
            time.sleep(3600)  # stuck reading a file, say
        return torch.full((4,), float(i % 7)), torch.ones(1)


accelerator = Accelerator(cpu=True)
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
        if rank == 0:
            accelerator.gather(loss.detach().reshape(1, 1).expand(2, 3).contiguous())
        accelerator.wait_for_everyone()
    if mode == "straggler" and rank == 1:
        time.sleep(0.3)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"steps": step}, f)
