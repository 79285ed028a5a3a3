"""Checks of gradient synchronisation and accumulation on the processes hasten is started on.

    hasten launch --num_processes 2 --cpu path/to/test_sync.py
    debug_launcher(test_sync.main)                # from hasten.test_utils import test_sync

- ``no_sync``: inside it, each process keeps its own gradients; outside, every process holds the
  average of all processes' gradients (one process: ``no_sync`` changes nothing);
- ``accumulate``: with ``gradient_accumulation_steps=2`` the optimizer steps (and the scheduler
  moves) only every second batch and at the end of the dataloader, and N processes x batch B x 2
  steps end with the weights of one process with batch 2*N*B; likewise with ``sync_each_batch``;
- the gradient state follows nested dataloaders (``active_dataloader``, ``end_of_dataloader``).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from hasten import Accelerator, PartialState
from hasten.state import AcceleratorState, GradientState
from hasten.test_utils.testing import are_the_same_tensors
from hasten.test_utils.training import RegressionDataset, RegressionModel
from hasten.utils import GradientAccumulationPlugin, gather, set_seed


def fresh_accelerator(**kwargs) -> Accelerator:
    """A new Accelerator with the given settings (the process group is kept)."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([p.grad.detach().reshape(()) for p in model.parameters()])


def _loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def check_no_sync() -> None:
    acc = fresh_accelerator()
    set_seed(42)
    model = acc.prepare(RegressionModel(a=1.0, b=1.0))
    # Different data on each process, so that local gradients differ.
    x = torch.full((4,), float(acc.process_index + 1), device=acc.device)
    batch = {"x": x, "y": 3 * x}
    with acc.no_sync(model):
        acc.backward(_loss(model, batch))
    local = _grads(model)
    every_local = gather(local[None])
    if acc.num_processes > 1:
        assert not are_the_same_tensors(local), "gradients were synchronised inside no_sync"
    model.zero_grad()
    acc.backward(_loss(model, batch))
    synced = _grads(model)
    assert are_the_same_tensors(synced), "gradients differ between processes outside no_sync"
    assert torch.allclose(synced, every_local.mean(0), rtol=1e-5), (
        f"synchronised gradients {synced.tolist()} are not the mean of the local ones {every_local.tolist()}")


def check_accumulate(sync_each_batch: bool) -> None:
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    acc = fresh_accelerator(gradient_accumulation_plugin=plugin)
    n, batch = acc.num_processes, 4
    # 5 global micro-batches: the last optimizer step has a single micro-batch (end of dataloader).
    dataset = RegressionDataset(length=5 * n * batch, seed=7)
    set_seed(42)
    model = RegressionModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    model, opt, sched, loader = acc.prepare(model, opt, sched, DataLoader(dataset, batch_size=batch))
    syncs = []
    for step, b in enumerate(loader):
        before = acc.unwrap_model(model).a.detach().clone()
        lr = opt.param_groups[0]["lr"]
        with acc.accumulate(model):
            acc.backward(_loss(model, b))
            opt.step()
            sched.step()
            opt.zero_grad()
        syncs.append(acc.sync_gradients)
        moved = not torch.equal(before, acc.unwrap_model(model).a.detach())
        assert moved == acc.sync_gradients, f"step {step}: weights moved={moved}, sync_gradients={acc.sync_gradients}"
        if not acc.sync_gradients:
            assert opt.param_groups[0]["lr"] == lr, f"step {step}: the scheduler moved without an optimizer step"
    assert syncs == [False, True, False, True, True], f"sync_gradients per batch: {syncs}"

    # One process with the accumulated global batch; the lr schedule of the run above, applied by hand.
    set_seed(42)
    reference = RegressionModel().to(acc.device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 0.5 ** step)
    micro = [{k: v.to(acc.device) for k, v in b.items()} for b in DataLoader(dataset, batch_size=n * batch)]
    for group in (micro[0:2], micro[2:4], micro[4:5]):
        for b in group:
            # As Accelerate does, backward divides every loss by the accumulation steps, the lone
            # last micro-batch's too.
            (_loss(reference, b) / 2).backward()
        ref_opt.step()
        # As in Accelerate, a prepared scheduler (without split_batches) steps once per process for
        # each optimizer step: its schedule counts batches of one process's size.
        for _ in range(n):
            ref_sched.step()
        ref_opt.zero_grad()
    got = acc.unwrap_model(model)
    for name in ("a", "b"):
        mine, want = getattr(got, name).detach(), getattr(reference, name).detach()
        assert torch.allclose(mine, want, rtol=1e-5, atol=1e-6), (
            f"sync_each_batch={sync_each_batch}: {name}={mine.item()} after accumulating on {n} process(es), "
            f"{want.item()} with one process and the whole batch")


def check_dataloader_nesting() -> None:
    acc = fresh_accelerator()
    outer, inner = acc.prepare(DataLoader(list(range(4 * acc.num_processes)), batch_size=1),
                               DataLoader(list(range(2 * acc.num_processes)), batch_size=1))
    state = acc.gradient_state
    assert state.active_dataloader is None
    for i, _ in enumerate(outer):
        assert state.active_dataloader is outer
        if i == 1:
            for j, _ in enumerate(inner):
                assert state.active_dataloader is inner
                assert state.end_of_dataloader == (j == len(inner) - 1), (j, state.end_of_dataloader)
            assert state.active_dataloader is outer
        assert state.end_of_dataloader == (i == len(outer) - 1), (i, state.end_of_dataloader)
    assert state.active_dataloader is None


def main() -> None:
    state = PartialState()
    checks = [("no_sync", check_no_sync), ("accumulate", lambda: check_accumulate(False)),
              ("accumulate, sync_each_batch", lambda: check_accumulate(True)),
              ("dataloader nesting", check_dataloader_nesting)]
    for name, check in checks:
        check()
        state.wait_for_everyone()
        state.print(f"{name}: ok on {state.num_processes} process(es)")


if __name__ == "__main__":
    main()
