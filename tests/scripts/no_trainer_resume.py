"""The resume pattern of transformers' ``run_*_no_trainer.py`` scripts, in small (written for hasten's tests).

``python no_trainer_resume.py OUT`` trains 2 epochs of a model with dropout on a shuffled DataLoader
and saves the state after step 2 (mid-epoch) to ``OUT/step_2``; ``python no_trainer_resume.py OUT
CHECKPOINT`` resumes as the scripts do: ``load_state``, then the interrupted epoch through
``skip_first_batches(loader, n)`` and the next ones through ``loader``. Each step prints a JSON line
(the samples of the batch on this rank, a fingerprint of the global torch generator before the
forward pass); the main process writes the final weights to ``OUT/weights.pt``.
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader

from hasten import Accelerator
from hasten.utils import set_seed


def main() -> None:
    out = sys.argv[1]
    resume = sys.argv[2] if len(sys.argv) > 2 else None
    accelerator = Accelerator()
    set_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    samples = [torch.tensor([float(i), (i % 5) / 5]) for i in range(24)]
    loader = DataLoader(samples, batch_size=3, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    completed, start_epoch, resume_step = 0, 0, None
    if resume:
        accelerator.load_state(resume)
        completed = int(os.path.basename(resume).split("_")[1])
        start_epoch, resume_step = divmod(completed, len(loader))
    for epoch in range(start_epoch, 2):
        model.train()
        active = loader
        if resume and epoch == start_epoch and resume_step:
            active = accelerator.skip_first_batches(loader, resume_step)
        for batch in active:
            rng = float(torch.rand(1, generator=torch.Generator().set_state(torch.get_rng_state())))
            loss = (model(batch / torch.tensor([24.0, 1.0], device=batch.device)) - 1).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            completed += 1
            print(json.dumps({"rank": accelerator.process_index, "step": completed,
                              "samples": batch[:, 0].int().tolist(), "rng": rng}), flush=True)
            if completed == 2 and not resume:
                accelerator.save_state(os.path.join(out, "step_2"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save({k: v.cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()},
                   os.path.join(out, "weights.pt"))


if __name__ == "__main__":
    main()
