"""Train with Accelerate and save_state, or resume from that folder with Accelerate or hasten.

The script runs unchanged with either library (hasten keeps Accelerate's names), so the resumed
numbers of the two can be compared: ``python accelerate_migration.py LIB MODE FOLDER OUT [bin]``
with LIB ``accelerate`` or ``hasten``, MODE ``save`` or ``resume``. ``resume`` writes, per process,
the weights after one more step on a fixed batch, the learning rate, the step counter, the custom
object's state and one draw of each random generator after load_state.
"""

import importlib
import json
import random
import sys

import numpy as np
import torch

lib, mode, folder, out = sys.argv[1:5]
safe = "bin" not in sys.argv[5:]
Accelerator = importlib.import_module(lib).Accelerator


class Counter:
    def __init__(self):
        self.count, self.total = 0, torch.zeros(3)

    def state_dict(self):
        return {"count": self.count, "total": self.total}

    def load_state_dict(self, state):
        self.count, self.total = state["count"], state["total"]


torch.manual_seed(0 if mode == "save" else 123)  # resume starts from other weights: load_state must matter
acc = Accelerator(cpu=True)
data = torch.arange(96, dtype=torch.float32).reshape(24, 4).sin()
target = data @ torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.2, -1.0], [1.5, 0.0, 0.4], [-0.7, 1.1, 0.9]])
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, target), batch_size=4, shuffle=True)
model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
counter = Counter()
acc.register_for_checkpointing(counter)


def step(x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    counter.count += 1
    counter.total += y.sum(0)


if mode == "save":
    for i, (x, y) in enumerate(loader):
        step(x, y)
        if i == 2:
            break
    acc.save_state(folder, safe_serialization=safe)
else:
    acc.load_state(folder)
    draws = {"torch": torch.rand(2).tolist(), "numpy": np.random.rand(2).tolist(), "python": random.random()}
    rank = acc.process_index
    x, y = data[4 * rank:4 * rank + 4].to(acc.device), target[4 * rank:4 * rank + 4].to(acc.device)
    step(x, y)  # the same batch in both libraries (their shuffled orders differ)
    weights = {k: v.tolist() for k, v in acc.unwrap_model(model).state_dict().items()}
    result = {"weights": weights, "lr": sched.get_last_lr(), "step": acc.step, "draws": draws,
              "counter": [counter.count, counter.total.tolist()],
              "adam_steps": [float(s["step"]) for s in opt.state_dict()["state"].values()]}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
