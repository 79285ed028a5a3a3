"""Accelerate's Megatron-LM launch on the native layout. Usage: launch_megatron.py OUT [plugin]

Trains two pipelined steps of a small nn.Sequential with the layout the launcher gave (``PARALLELISM_CONFIG_*``
from ``--use_megatron_lm --megatron_lm_pp_degree ...``); with ``plugin``, the script passes its own
``MegatronLMPlugin()`` (read from the ``MEGATRON_LM_*`` variables) instead, as an Accelerate Megatron script
does. Each rank writes OUT/rank<r>.json: the layout and the losses.
"""

import json
import os
import sys

import torch
from torch import nn

from hasten import Accelerator
from hasten.pipeline import pipeline_loss

out = sys.argv[1]
kwargs = {}
if len(sys.argv) > 2 and sys.argv[2] == "plugin":
    from hasten.utils import MegatronLMPlugin

    kwargs["megatron_lm_plugin"] = MegatronLMPlugin()
accelerator = Accelerator(cpu=True, **kwargs)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])
pipeline_loss(model, nn.functional.mse_loss)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(8, 4)
losses = []
for _ in range(2):
    loss = model(x, labels=x.sin()).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
cfg = accelerator.state.parallelism_config if hasattr(accelerator.state, "parallelism_config") else None
cfg = cfg or getattr(accelerator, "parallelism_config", None)
with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
    json.dump({"pp_size": cfg.pp_size, "tp_size": cfg.tp_size, "pp_microbatches": cfg.pp_microbatches,
               "losses": losses}, f)
