"""One rank of a 2-process FSDP2 job that resumes, then saves sharded checkpoints back to back until killed.

Each save follows one optimizer step and sets every weight to the step number, so a checkpoint
is consistent when its weights equal its recorded step. Rank 0 prints ``hello <resumed step>
<weights ok>`` after resuming and ``saved <step>`` after each save (the test kills both ranks
with SIGKILL at a random moment after the first save of the round). With SAVES=0 it only resumes
and reports. With MODE "background" it saves with ``save_state(blocking=False)`` (each save waits
for the previous one; the first of the round is waited for before ``saved``), so most kills land
while a background thread writes the shards and the next step changes the live weights.

The process is a fork server for its rank (torch and hasten imported once, not once per job): it
reads one job a line from stdin, JSON ``[PROJECT_DIR, SAVES, MODE, MASTER_PORT]``, forks a child that runs it
(its output on this process's stdout), prints ``pid <child>`` first and ``exit <status>`` once the
child is gone (the test SIGKILLs the child, never this process). Ends at end of input.

Usage (RANK, WORLD_SIZE, MASTER_ADDR... in the environment): python ckpt_killer_sharded.py
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)

from hasten import Accelerator  # noqa: E402
from hasten.utils import ProjectConfiguration  # noqa: E402
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin  # noqa: E402
from ckpt_step import Step  # noqa: E402 - beside this script

# What every job imports, imported once here (before any fork, so the children start with it).
import hasten.checkpointing.sharded  # noqa: E402, F401
import hasten.strategies.fsdp2  # noqa: E402, F401
import torch.distributed.checkpoint  # noqa: E402, F401


def job(project: str, saves: int, blocking: bool) -> None:
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
    acc.end_training()


def main() -> None:
    # Warm up what the jobs use (the first optimizer step imports a lot), so that a forked job starts at once.
    warm = torch.nn.Linear(2, 2)
    torch.optim.Adam(warm.parameters()).step()
    for line in sys.stdin:
        project, saves, mode, port = json.loads(line)
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns
            status = 1
            try:
                os.close(go_write)
                os.read(go_read, 1)  # its pid is printed before anything it prints
                os.environ["MASTER_PORT"] = str(port)
                job(project, int(saves), mode != "background")
                status = 0
            finally:
                sys.stdout.flush()
                os._exit(status)
        os.close(go_read)
        print(f"pid {pid}", flush=True)
        os.write(go_write, b"1")
        os.close(go_write)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    main()
