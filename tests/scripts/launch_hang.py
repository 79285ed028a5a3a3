"""Hangs and stragglers under `hasten launch` (2 CPU processes). Usage: launch_hang.py MODE OUT

`skip`: rank 1 skips a gather (as under `if accelerator.is_main_process:`) and goes on to
wait_for_everyone, while rank 0 waits in the gather. `loader`: rank 1's dataset sleeps forever in
__getitem__ at batch 3 while rank 0 goes on to backward (DDP's all-reduce); the script sets its own
hang timeout (8 s). `straggler`: rank 1 sleeps 0.3 s per step. `normal`: a healthy run that starts
slowly: 8 s before hasten is used (like a slow `import torch`), then, with the process group up
but before any collective, rank 0 sleeps 7 s (silent) and rank 1 works 20 s in Python (a slow
model load) while rank 0 already waits for it in `prepare`'s collectives. `setup`: before any training step,
rank 0 calls `accelerator.reduce` (as under `if accelerator.is_main_process:`) while rank 1 calls
`wait_for_everyone`. `setup_torch`: the same with torch.distributed called directly (all_reduce on
rank 0, barrier on rank 1), so no hasten progress mark at all. Each rank writes OUT/rank<r>.json
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


def read_shard():
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        pass


def convert_shard():
    until = time.monotonic() + 0.45  # phases of 0.75 s: the heartbeat (once a second) finds either
    while time.monotonic() < until:
        pass


if mode == "normal":
    if accelerator.is_main_process:
        time.sleep(7)
    else:
        for shard in range(int(os.environ.get("LOAD_SHARDS", "27"))):  # 20 s
            read_shard()
            convert_shard()
if mode in ("setup", "setup_torch"):
    time.sleep(2)  # a little set-up work first
    hanging_now()
    one = torch.ones(1, device=accelerator.device)
    if mode == "setup":
        if accelerator.is_main_process:
            accelerator.reduce(one)
        accelerator.wait_for_everyone()
    elif accelerator.is_main_process:
        torch.distributed.all_reduce(one)
    else:
        torch.distributed.barrier()
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
