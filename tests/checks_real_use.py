"""Checks written the way scripts use hasten (objects made in loops, tensors that require grad,
early ``break``, accumulation micro-steps), run inside each rank (see distributed.py)."""

import torch
from torch import nn
from torch.utils.data import DataLoader

from hasten import Accelerator
from hasten.state import PartialState
from hasten.utils import operations as ops


def _world():
    s = PartialState()
    return s.num_processes, s.process_index


# -- prepare in a loop --------------------------------------------------------------------------------
def check_prepare_dataloaders_in_a_loop():
    """A new DataLoader per (length, batch size), the previous one freed: each gathers its own items."""
    acc = Accelerator()
    wrong = []
    for n in range(1, 14):
        for bs in range(1, 5):
            items = list(range(100 * n + 10 * bs, 100 * n + 10 * bs + n))
            loader = acc.prepare(DataLoader(items, batch_size=bs))  # the user's loader is freed at once
            got = []
            for batch in loader:
                got += acc.gather_for_metrics(batch).tolist()
            if got != items:
                wrong.append([n, bs, got])
            del loader
    assert wrong == [], wrong
    return len(acc._dataloaders)


def check_prepare_every_kind_in_a_loop():
    """Models, optimizers, schedulers and loaders made in a loop: each prepared object is its own."""
    acc = Accelerator()
    for i in range(12):
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (i + 1))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        loader = DataLoader(list(range(i + 1)), batch_size=2)
        p_model, p_opt, p_sched, p_loader = acc.prepare(model, optimizer, scheduler, loader)
        assert acc.unwrap_model(p_model) is model
        assert p_opt.optimizer is optimizer and p_sched.scheduler is scheduler
        assert p_loader.dataset is loader.dataset
        again = acc.prepare(model, optimizer, scheduler, loader)  # idempotent for the live objects
        assert all(a is b for a, b in zip(again, (p_model, p_opt, p_sched, p_loader)))
        assert all(a is b for a, b in zip(acc.prepare(p_model, p_opt, p_sched, p_loader),
                                          (p_model, p_opt, p_sched, p_loader)))
        del model, optimizer, scheduler, loader, p_model, p_opt, p_sched, p_loader, again
    return [len(acc._models), len(acc._optimizers), len(acc._schedulers), len(acc._dataloaders)]
