"""Rank 1 dies mid-training once; ``--max_restarts`` + ``resume="auto"`` must bring the job back.

Usage (under ``hasten launch --max_restarts 1``): attack_restart.py OUT PROJECT HOW [RANK] [SAVE]
  exit   on the first attempt rank RANK (default 1) ends with ``os._exit(3)`` right after the
         checkpoint of step 4
  raise  on the first attempt that rank raises an error right after that checkpoint
  SAVE   "blocking" (default) or "background" (``save_state(blocking=False)``)
Every rank prints and writes OUT/rank<r>.json at the end: attempt, the step it resumed from, steps done.
"""

import json
import os
import sys

import torch
from torch import nn

from hasten import Accelerator
from hasten.utils import ProjectConfiguration, set_seed

out, project, how = sys.argv[1], sys.argv[2], sys.argv[3]
dying = int(sys.argv[4]) if len(sys.argv) > 4 else 1
blocking = (sys.argv[5] if len(sys.argv) > 5 else "blocking") == "blocking"
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
TOTAL, EVERY, DIE_AT = 8, 2, 4


class Steps:
    def __init__(self):
        self.done = 0

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


set_seed(0)
acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=2),
                  resume="auto")
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
steps = Steps()
acc.register_for_checkpointing(steps)
resumed_at = steps.done
print(f"rank {acc.process_index} attempt {attempt} resumed from step {resumed_at}", flush=True)

g = torch.Generator().manual_seed(acc.process_index)
while steps.done < TOTAL:
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    steps.done += 1
    if steps.done % EVERY == 0:
        acc.save_state(blocking=blocking)
    if attempt == 0 and acc.process_index == dying and steps.done == DIE_AT:
        acc.wait_for_checkpoint()
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"injected failure at step {steps.done}")

with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"attempt": attempt, "resumed_at": resumed_at, "steps": steps.done}, f)
acc.end_training()
