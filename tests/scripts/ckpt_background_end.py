"""A script whose last line is ``save_state(blocking=False)``: the checkpoint must still be complete.

Usage: ckpt_background_end.py PROJECT MODE (or ``main(project, mode)`` from notebook_launcher)
  late     train a few steps, start a background save and return at once; rank 1 writes to a
           slow disk, so its files come well after rank 0 reached the end of the script (and the
           process group would go)
  destroy  like late (both ranks with slow disks), then the script destroys the process group
           itself: the save must fail loudly and commit nothing
  load     build the same objects and load the newest checkpoint
Each rank writes PROJECT/saved<rank>.json (weights at the save) or PROJECT/loaded<rank>.json.
A third argument ``fsdp`` runs the model under FSDP2 (sharded DCP files, staged for the background
write); the weights are then each process's own shards.
"""

import json
import os
import sys
import time

import torch
from torch import nn

from hasten import Accelerator
from hasten.utils import ProjectConfiguration, set_seed


def weights(model):
    local = [getattr(p.detach(), "to_local", p.detach)() for p in model.parameters()]  # FSDP2: own shards
    return sum(float(t.double().sum()) for t in local)


def slow_disk():
    """This process's files reach the disk 2 s late (a slow or busy filesystem on one node): a commit
    that does not wait for every process misses them."""
    from hasten.checkpointing import saver

    write = saver.Writer.write

    def slow_write(self, item):
        time.sleep(2)
        return write(self, item)

    saver.Writer.write = slow_write


def main(project, mode, layout="ddp"):
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    os.makedirs(project, exist_ok=True)
    set_seed(0)
    acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if layout == "fsdp" else None)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    model, opt, dl = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    if mode == "load":
        folder = acc.load_state()
        with open(os.path.join(project, f"loaded{acc.process_index}.json"), "w") as f:
            json.dump({"folder": folder, "weights": weights(model), "world": acc.num_processes}, f)
        return
    for step, (x, y) in enumerate(dl):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if step == 2:
            break
    with open(os.path.join(project, f"saved{acc.process_index}.json"), "w") as f:
        json.dump({"weights": weights(model)}, f)
    if acc.process_index == 1 or mode == "destroy":
        slow_disk()
    acc.save_state(blocking=False)
    if mode == "destroy_mid":  # rank 0's save waits for rank 1 inside a collective by now
        time.sleep(1)
    if mode.startswith("destroy"):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
