"""Child processes of tests/test_attack_commit.py.

``crash PROJECT MODE EXCHANGE K VALUE``: save one checkpoint (weights filled with VALUE) and
``os._exit(17)`` just before the K-th filesystem step of the commit (a rename, replace, exchange,
rmtree or rmdir). MODE ``auto``: automatic naming with total_limit=2; ``replace``: the fixed folder
PROJECT/ckpt replaced. EXCHANGE ``0`` forces the path without an atomic exchange. Prints ``done``
when the save finished before step K.

``nodes PROJECT OUT``: one of two processes, each its own node (LOCAL_WORLD_SIZE=1), saving with
``save_on_each_node=True`` and an FSDP2 (sharded) model; writes the error it got to OUT.

``agree FOLDER OUT``: one of two processes loading the tampered checkpoint FOLDER; writes the error to OUT.
"""

import json
import os
import shutil
import sys

import torch

from hasten import Accelerator
from hasten.checkpointing import layout
from hasten.utils import ProjectConfiguration


class Counter:
    def __init__(self, value=0.0):
        self.value = value

    def state_dict(self):
        return {"value": self.value, "t": torch.tensor([float(self.value)])}

    def load_state_dict(self, state):
        self.value = state["value"]


def model_and_opt(acc, value):
    """As tests/test_attack_commit.py's ``make``: a registered Counter, a Linear, SGD and StepLR."""
    acc.register_for_checkpointing(Counter(value))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    return acc.prepare(model, opt, sched)


def crash(project, mode, exchange, k, value):
    cfg = ProjectConfiguration(project, automatic_checkpoint_naming=mode == "auto", total_limit=2,
                               iteration=int(value))
    acc = Accelerator(project_config=cfg)
    model_and_opt(acc, value)
    if exchange == "0":
        layout._exchange = lambda a, b: False
    count = [0]

    def step(real):
        def wrapper(*args, **kwargs):
            if count[0] == k:
                sys.stdout.flush()
                os._exit(17)
            count[0] += 1
            return real(*args, **kwargs)
        return wrapper

    if exchange != "0":
        layout._exchange = step(layout._exchange)
    os.rename, os.replace, os.rmdir = step(os.rename), step(os.replace), step(os.rmdir)
    shutil.rmtree = step(shutil.rmtree)
    acc.save_state(None if mode == "auto" else os.path.join(project, "ckpt"))
    layout.wait_for_deletions()
    print("done", count[0], flush=True)


def nodes(project, out):
    from hasten.utils import FullyShardedDataParallelPlugin as Plugin

    cfg = ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=1, save_on_each_node=True)
    acc = Accelerator(project_config=cfg, fsdp_plugin=Plugin(fsdp_version=2))
    model_and_opt(acc, 1.0)
    result = {"num_machines": acc.state.num_machines}
    try:
        acc.save_state()
        result["error"] = None
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump(result, f)
    acc.end_training()


def agree(folder, out):
    acc = Accelerator()
    model_and_opt(acc, 0.0)
    result = {}
    try:
        acc.load_state(folder)
        result["error"] = None
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump(result, f)
    acc.end_training()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "crash":
        crash(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
    elif what == "nodes":
        nodes(sys.argv[2], sys.argv[3])
    else:
        agree(sys.argv[2], sys.argv[3])
