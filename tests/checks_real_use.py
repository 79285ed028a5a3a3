"""Checks written the way scripts use hasten (objects made in loops, tensors that require grad,
early ``break``, accumulation micro-steps), run inside each rank (see distributed.py)."""

import torch
from torch import nn
from torch.utils.data import DataLoader

from hasten import Accelerator
from hasten.state import PartialState
from hasten.utils import DataLoaderConfiguration, GradScalerKwargs
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


# -- collectives of tensors that require grad ----------------------------------------------------------
def check_collectives_accept_tensors_that_require_grad():
    """An evaluation written without no_grad gathers losses that require grad (every collective)."""
    n, rank = _world()
    device = PartialState().device  # where a script's tensors are (NCCL moves CUDA tensors only)
    weight = torch.ones(3, device=device, requires_grad=True)
    y = weight * (rank + 1)  # a non-leaf that requires grad
    out = {
        "gather": ops.gather(y).tolist(),
        "gather_leaf": ops.gather(weight).tolist(),
        "gather_nested": ops.gather({"a": [y]})["a"][0].tolist(),
        "reduce": ops.reduce(y, "sum").tolist(),
        "reduce_leaf": ops.reduce(weight, "mean").tolist(),
        "pad": ops.pad_across_processes(y[: rank + 1]).tolist(),
        "gather_object": [t.tolist() for t in ops.gather_object([y])],
    }
    leaf = torch.full((2, 3), float(rank), device=device).t().contiguous().t().requires_grad_()  # a non-contiguous leaf
    ops.broadcast(leaf)
    out["broadcast_leaf"] = leaf.tolist()
    moved = y.clone()
    ops.broadcast(moved, from_process=n - 1)
    out["broadcast"] = moved.tolist()
    acc = Accelerator(even_batches=False)
    got = []
    for batch in acc.prepare(DataLoader(list(range(7)), batch_size=2)):
        loss = (weight * batch.float().mean()).sum()
        got += acc.gather_for_metrics(loss.repeat(batch.shape[0])).tolist()  # Accelerate's example does this
    out["gather_for_metrics"] = got
    acc.even_batches = True
    got = [acc.gather_for_metrics((weight.sum() * batch).float()).tolist()
           for batch in acc.prepare(DataLoader(list(range(5)), batch_size=2))]
    out["gather_for_metrics_padded"] = got
    return out


# -- clipping on accumulation micro-steps --------------------------------------------------------------
def _clip_run(precision):
    from distributed import reset_state

    reset_state()
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision=precision, gradient_accumulation_steps=2,
                      kwargs_handlers=[GradScalerKwargs(init_scale=256.0)])
    model = nn.Linear(4, 1)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = acc.prepare(DataLoader(torch.randn(8, 4), batch_size=2))
    scale = acc.scaler.get_scale() if acc.scaler is not None else 1.0
    rows = []
    for batch in data:
        with acc.accumulate(model):
            acc.backward(model(batch).pow(2).mean())
            before = [p.grad.clone() for p in model.parameters()]
            expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before])) / scale
            norm = acc.clip_grad_norm_(model.parameters(), max_norm=1e-3)
            unchanged = all(torch.equal(g, p.grad) for g, p in zip(before, model.parameters()))
            rows.append([acc.sync_gradients, norm.item(), expected.item(), unchanged])
            optimizer.step()
            optimizer.zero_grad()
    return rows


def check_clip_grad_norm_on_micro_steps_returns_the_norm():
    """``norm = accelerator.clip_grad_norm_(...)`` then ``norm.item()`` on every step of an accumulation."""
    return {precision: _clip_run(precision) for precision in ("no", "fp16")}


# -- leaving a loop early ----------------------------------------------------------------------------
def _epochs(loader, acc, passes):
    return [[x for batch in loader for x in acc.gather_for_metrics(batch).tolist()] for _ in range(passes)]


def check_break_keeps_the_position_and_a_new_for_starts_the_next_epoch():
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=7, use_seedable_sampler=True))
    reference = _epochs(acc.prepare(DataLoader(list(range(20)), batch_size=2, shuffle=True)), acc, 3)
    loader = acc.prepare(DataLoader(list(range(20)), batch_size=2, shuffle=True))
    out = {"reference": reference}
    for i, _ in enumerate(loader):
        if i == 1:
            break  # e.g. a step budget
    out["after_break"] = loader.state_dict()
    try:
        for i, _ in enumerate(loader):
            if i == 2:
                raise KeyboardInterrupt  # an exception that the script catches before saving
    except KeyboardInterrupt:
        pass
    out["after_exception"] = loader.state_dict()
    out["next_for"] = _epochs(loader, acc, 1)[0]  # a new pass: the next epoch, every item once
    out["after_full_pass"] = loader.state_dict()
    for i, _ in enumerate(loader):
        if i == len(loader) - 1:
            break  # at the last batch: the epoch is complete
    out["break_at_last_batch"] = loader.state_dict()
    return out


# -- the user's own generator ----------------------------------------------------------------------------
def _reseeded_epochs(loader, generator, acc=None):
    epochs = []
    for seed in (42, 42, 7):
        generator.manual_seed(seed)  # before each epoch, as scripts do for reproducible shuffles
        epochs.append([x for batch in loader for x in (acc.gather_for_metrics(batch) if acc else batch).tolist()])
    return epochs


def check_user_generator_drives_the_order():
    """Re-seeding the DataLoader's own generator repeats a plain DataLoader's order after prepare."""
    plain_generator = torch.Generator()
    plain = _reseeded_epochs(DataLoader(list(range(16)), batch_size=2, shuffle=True, generator=plain_generator),
                             plain_generator)
    acc = Accelerator()
    generator = torch.Generator()
    prepared = acc.prepare(DataLoader(list(range(16)), batch_size=2, shuffle=True, generator=generator))
    return {"plain": plain, "prepared": _reseeded_epochs(prepared, generator, acc)}
