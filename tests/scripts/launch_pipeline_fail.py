"""A pipelined run (pp_size=2, 1F1B, 2 microbatches) whose stage 1 breaks in its forward at step 2.

Usage: launch_pipeline_fail.py MODE OUT. `raise`: rank 1 raises ``RuntimeError("stage forward broke")``
inside its stage's forward of microbatch 0 during the second call of the model; rank 0 (stage 0) is
then left waiting for the gradients of stage 1. `hang`: rank 1 sleeps there instead (a stuck stage).
Each rank writes OUT/hang<r> with the time (time.monotonic) just before step 2.
"""

import os
import sys
import time

import torch
from torch import nn

from hasten import Accelerator
from hasten.pipeline import pipeline_loss
from hasten.utils.parallelism_config import ParallelismConfig

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
STEP = [0]


class Breaks(nn.Module):
    def forward(self, x):
        if STEP[0] == 2 and rank == 1:
            if mode == "hang":
                time.sleep(3600)
            raise RuntimeError("stage forward broke")
        return x


accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B",
                                                                         pp_microbatches=2))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Sequential(Breaks(), nn.Linear(4, 4)), nn.Tanh())
pipeline_loss(model, nn.functional.mse_loss)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(8, 4)
for step in (1, 2, 3):
    STEP[0] = step
    if step == 2:
        with open(os.path.join(out, f"hang{rank}"), "w") as f:
            f.write(repr(time.monotonic()))
    loss = model(x, labels=x.sin()).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
