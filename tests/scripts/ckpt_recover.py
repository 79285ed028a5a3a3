"""A training script that survives its own death: ``resume="auto"`` + periodic ``save_state``.

Usage (under ``hasten launch``): ckpt_recover.py OUT PROJECT MODE
  clean    train to the end
  kill     on the first attempt rank 1 SIGKILLs itself inside the save at micro-step 6
  preempt  ``save_on_preemption()``; rank 1 waits for a SIGTERM after micro-step 5 (the test sends it)
Every rank writes OUT/rank<r>.json at the end: attempt, the checkpoint resumed from, final weights.
"""

import json
import os
import signal
import sys
import time

import torch
from torch import nn

from hasten import Accelerator
from hasten.utils import ProjectConfiguration, set_seed

out, project, mode = sys.argv[1], sys.argv[2], sys.argv[3]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g)

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(6), self.y[i]


class Steps:
    def __init__(self):
        self.done = 0

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


set_seed(0)
acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=2),
                  gradient_accumulation_steps=2, resume="auto")
model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
dl = torch.utils.data.DataLoader(Data(), batch_size=4, shuffle=True)
model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
steps = Steps()
acc.register_for_checkpointing(steps)
resumed_at = steps.done

if mode == "kill" and attempt == 0 and acc.process_index == 1:
    if acc.distributed_type == "DEEPSPEED":  # die once DeepSpeed has written this rank's engine files
        engine_save = model.save_checkpoint

        def die_after_engine_files(*args, **kwargs):
            engine_save(*args, **kwargs)
            if steps.done == 6:
                os.kill(os.getpid(), signal.SIGKILL)
        model.save_checkpoint = die_after_engine_files
    else:
        def die_inside_save(models, weights, folder):
            if steps.done == 6:
                os.kill(os.getpid(), signal.SIGKILL)
        acc.register_save_state_pre_hook(die_inside_save)
handler = acc.save_on_preemption() if mode == "preempt" else None

for epoch in range(dl.iteration, 2):
    for x, y in dl:
        with acc.accumulate(model):
            loss = ((model(x) - y) ** 2).mean()
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        steps.done += 1
        if steps.done % 2 == 0:
            acc.save_state()
        if mode == "preempt" and attempt == 0 and steps.done == 5:
            with open(os.path.join(out, f"pid{acc.process_index}"), "w") as f:
                f.write(str(os.getpid()))
            if acc.process_index == 1:  # wait here for the test's SIGTERM (delivered to this rank only)
                deadline = time.monotonic() + 60
                while handler.received is None and time.monotonic() < deadline:
                    time.sleep(0.01)

weights = {k: v.tolist() for k, v in acc.unwrap_model(model).state_dict().items()}
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"attempt": attempt, "resumed_at": resumed_at, "steps": steps.done, "weights": weights,
               "mode": mode}, f)
