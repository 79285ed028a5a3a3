"""One rank of a 2-process FSDP2 job that resumes, then saves sharded checkpoints back to back until killed.

Each save follows one optimizer step and sets every weight to the step number, so a checkpoint
is consistent when its weights equal its recorded step. Rank 0 prints ``hello <resumed step>
<weights ok>`` after resuming and ``saved <step>`` after each save (the test kills both ranks
with SIGKILL at a random moment after the first save of the round). With SAVES=0 it only resumes
and reports. With MODE "background" it saves with ``save_state(blocking=False)`` (each save waits
for the previous one; the first of the round is waited for before ``saved``), so most kills land
while a background thread writes the shards and the next step changes the live weights.

Usage (torchrun-style environment): python ckpt_killer_sharded.py PROJECT_DIR SAVES [MODE]
"""

import sys

import torch

torch.set_num_threads(1)

from hasten import Accelerator  # noqa: E402
from hasten.utils import ProjectConfiguration  # noqa: E402
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin  # noqa: E402
from ckpt_step import Step  # noqa: E402 - beside this script


def main() -> None:
    project, saves = sys.argv[1], int(sys.argv[2])
    blocking = (sys.argv[3] if len(sys.argv) > 3 else "blocking") != "background"
    acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=2),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), resume="auto")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    step = Step()
    acc.register_for_checkpointing(step)  # resume="auto" restores it here
    full = acc.get_state_dict(model)  # process 0 holds the full weights
    ok = step.value < 0 or all(bool((w == float(step.value)).all()) for w in full.values())
    ok = ok and (step.value < 0 or len(opt.state) == 6)
    if acc.is_main_process:
        print(f"hello {step.value} {ok}", flush=True)
    x = torch.randn(4, 256)
    saves_start = step.value
    for _ in range(saves):
        step.value += 1
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(float(step.value))
        acc.save_state(blocking=blocking)
        if not blocking and step.value == saves_start + 1:
            acc.wait_for_checkpoint()
        if acc.is_main_process:
            print(f"saved {step.value}", flush=True)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
