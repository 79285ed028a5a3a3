"""Bodies of tests/test_data_order.py's two-process tests (run by tests/distributed.py)."""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import DataLoader

from distributed import reset_state
from hasten import Accelerator
from hasten.utils import set_seed
from hasten.utils.operations import broadcast_object_list, gather_object

EPOCHS = 3


def _global_steps(loader, epochs: int = EPOCHS) -> list:
    """Per step, the processes' batches end to end (process 0 first), for ``epochs`` passes."""
    steps = []
    for _ in range(epochs):
        for batch in loader:
            parts = gather_object([batch.tolist()])
            steps.append([i for part in parts for i in part])
    return steps


def resume_run(folder: str, mode: str) -> list:
    """One process: "full" trains 3 epochs and saves at step 2 of epoch 1 (a "saved" mark follows
    the batch of that step); "resume" scrambles the global generator, loads, and trains on."""
    set_seed(123)
    acc = Accelerator()
    loader = acc.prepare(DataLoader(list(range(26)), batch_size=4, shuffle=True))
    seen: list = []
    if mode == "resume":
        torch.manual_seed(999)  # whatever a fresh process's generator holds, load_state restores it
        acc.load_state(folder, continue_dataloaders=True)
    for epoch in range(EPOCHS if mode == "full" else 2):
        for step, batch in enumerate(loader):
            seen.append(batch.tolist())
            torch.rand(1)  # training's use of the global generator
            if mode == "full" and epoch == 1 and step == 2:
                acc.save_state(folder)
                seen.append("saved")
    return seen


def check_two_by_b_is_one_by_2b():
    reset_state()
    set_seed(42)
    acc = Accelerator()
    loader = acc.prepare(DataLoader(list(range(24)), batch_size=3, shuffle=True))
    return {"steps": _global_steps(loader)}


def check_ranks_agree_with_different_generators():
    reset_state()
    acc = Accelerator()
    torch.manual_seed(100 + acc.process_index)  # the ranks' global generators differ on purpose
    loader = acc.prepare(DataLoader(list(range(20)), batch_size=2, shuffle=True))
    return _global_steps(loader)


def check_two_process_resume():
    """Save at step 2 of epoch 1, go on to the end of epoch 2; then load in a new Accelerator whose
    global generators were scrambled and check that the same steps follow."""
    reset_state()
    set_seed(9)
    acc = Accelerator()
    folder = [tempfile.mkdtemp() if acc.is_main_process else None]
    broadcast_object_list(folder, from_process=0)
    folder = folder[0] + "/ckpt"

    def make():
        return DataLoader(list(range(22)), batch_size=2, shuffle=True)

    loader = acc.prepare(make())
    expected, saved = [], False
    for epoch in range(EPOCHS):
        for step, batch in enumerate(loader):
            torch.rand(1)
            if saved:
                expected.append(gather_object([batch.tolist()]))
            if epoch == 1 and step == 2:
                acc.save_state(folder)
                saved = True
    reset_state()
    acc = Accelerator()
    torch.manual_seed(1000 + acc.process_index)
    loader = acc.prepare(make())
    acc.load_state(folder, continue_dataloaders=True)
    resumed = []
    for _ in range(2):
        for batch in loader:
            torch.rand(1)
            resumed.append(gather_object([batch.tolist()]))
    return {"expected": expected, "resumed": resumed}
