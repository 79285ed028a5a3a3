"""Training with an evaluation loader whose length differs per process, under ``save_on_preemption``.

Usage (under ``hasten launch``, 2 processes): preempt_uneven.py OUT PROJECT MODE
  clean    train 2 epochs to the end (rank 0 evaluates 3 batches per epoch, rank 1 only 2)
  preempt  rank 1 sends itself SIGTERM during its last evaluation batch of epoch 0
  resume   resume="auto" from the newest checkpoint and train to the end
Every rank that finishes writes OUT/rank<r>.json (epochs, evaluated samples, final weights).
"""

import json
import os
import signal
import sys

import torch
from torch import nn

from hasten import Accelerator
from hasten.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

out, project, mode = sys.argv[1], sys.argv[2], sys.argv[3]
set_seed(0)
acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True),
                  dataloader_config=DataLoaderConfiguration(even_batches=False),
                  resume="auto" if mode == "resume" else None)
model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
train = torch.utils.data.DataLoader(torch.arange(48.0).reshape(16, 3) / 48, batch_size=2, shuffle=True)
evaluation = torch.utils.data.DataLoader(torch.arange(30.0).reshape(10, 3) / 30, batch_size=2)  # 5 batches: 3 + 2
model, opt, train, evaluation = acc.prepare(model, opt, train, evaluation)
if mode != "clean":
    acc.save_on_preemption()
evaluated = []
for epoch in range(train.iteration, 2):
    for x in train:
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    for i, x in enumerate(evaluation):
        with torch.no_grad():
            evaluated.append(len(acc.gather_for_metrics(model(x))))
        if mode == "preempt" and epoch == 0 and acc.process_index == 1 and i == len(evaluation) - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # one process only, mid-evaluation
weights = {k: v.tolist() for k, v in acc.unwrap_model(model).state_dict().items()}
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"evaluated": evaluated, "weights": weights, "epoch": train.iteration}, f)
