"""The script ``hasten test`` launches: quick checks that the processes really cooperate.

1. collectives: every rank's value arrives everywhere (gather, reduce);
2. data sharding: the ranks see disjoint parts of a dataset that together make all of it;
3. one optimizer step (a whole gradient-accumulation window) on N processes equals the same step
   on one process over the global batch.
Any mismatch raises, so the launcher reports the failing rank and exits non-zero.
"""

import copy
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator

MAX_SKIPPED_STEPS = 30  # fp16: the scaler halves its scale at each skipped step


def say(accelerator, text):
    if accelerator.is_main_process:
        print(f"hasten test: {text}", flush=True)


def check_collectives(accelerator):
    n, rank = accelerator.num_processes, accelerator.process_index
    got = accelerator.gather(torch.tensor([rank], device=accelerator.device)).cpu().tolist()
    if got != list(range(n)):
        raise AssertionError(f"gather of each rank's index gave {got}, expected {list(range(n))}")
    total = accelerator.reduce(torch.tensor([float(rank + 1)], device=accelerator.device), "sum").item()
    if total != n * (n + 1) / 2:
        raise AssertionError(f"sum over ranks of (rank + 1) gave {total}, expected {n * (n + 1) / 2}")
    say(accelerator, f"collectives ok (gather, reduce over {n} processes)")


def check_sharding(accelerator):
    n = accelerator.num_processes
    size = 6 * n + 1  # not a multiple of the process count: the last batch is uneven
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(size)), batch_size=2))
    mine, everything = [], []
    for (batch,) in loader:
        mine.extend(batch.cpu().tolist())
        everything.extend(accelerator.gather_for_metrics(batch).cpu().tolist())
    if sorted(everything) != list(range(size)):
        raise AssertionError(f"the ranks together saw {sorted(everything)}, expected 0..{size - 1} once each")
    counts = accelerator.gather(torch.tensor([len(set(mine))], device=accelerator.device)).cpu().tolist()
    if n > 1 and max(counts) >= size:
        raise AssertionError(f"one rank saw the whole dataset (samples per rank: {counts}); data is not sharded")
    say(accelerator, f"data sharding ok ({size} samples split as {counts})")


def _one_optimizer_step(accelerator, model, optimizer, loader):
    """One accumulation window over the whole loader (one optimizer step); the batches every rank
    used, gathered. With fp16 the gradient scaler skips a step whose gradients overflow at its
    starting scale (and lowers the scale): the window is then repeated until a step is taken."""
    # DeepSpeed's bf16/fp16 hold the weights themselves in that type (no autocast): inputs follow them.
    dtype = next(accelerator.unwrap_model(model).parameters()).dtype
    for _ in range(MAX_SKIPPED_STEPS + 1):
        used_x, used_y = [], []
        for bx, by in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(bx.to(dtype)).float(), by)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            used_x.append(accelerator.gather(bx).cpu().float())
            used_y.append(accelerator.gather(by).cpu().float())
        if not optimizer.step_was_skipped:
            return torch.cat(used_x), torch.cat(used_y)
    raise AssertionError(f"the optimizer skipped {MAX_SKIPPED_STEPS + 1} steps in a row (gradients not finite)")


def _clipping_in_step(model):
    """The gradient norm a DeepSpeed engine clips at inside its step (its ``gradient_clipping``; 0: none)."""
    clipping = getattr(model, "gradient_clipping", None)
    return float(clipping() or 0.0) if callable(clipping) else 0.0


def check_training_step(accelerator):
    torch.manual_seed(0)
    n, micro = accelerator.num_processes, accelerator.gradient_accumulation_steps
    model = torch.nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    # Each rank gets `micro` batches of 4: exactly one accumulation window, so one optimizer step.
    x, y = torch.randn(4 * n * micro, 4), torch.randn(4 * n * micro, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=4))
    gx, gy = _one_optimizer_step(accelerator, model, optimizer, loader)
    # The same step on one process, over the samples all ranks used in the window (equal batches:
    # the mean over all of them is what the accumulated, all-reduced gradients average).
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(gx), gy).backward()
    clip = _clipping_in_step(model)
    if clip:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    ref_opt.step()
    tol = 1e-5 if accelerator.mixed_precision == "no" else 2e-2
    # Full weights however the strategy holds them (FSDP shards: process 0 only; others get {}).
    trained = accelerator.get_state_dict(model)
    for name, q in reference.state_dict().items():
        if trained and not torch.allclose(trained[name].cpu().float(), q, atol=tol, rtol=tol):
            raise AssertionError(f"after one step, {name} differs from the single-process step: "
                                 f"{trained[name].cpu().flatten().tolist()} vs {q.flatten().tolist()}")
    flat = torch.cat([trained[k].reshape(-1).cpu().float() for k in sorted(trained)]) if trained else torch.zeros(0)
    sizes = accelerator.gather(torch.tensor([flat.numel()], device=accelerator.device)).cpu()
    if sizes.min() == sizes.max() > 0:
        every = accelerator.gather(flat.to(accelerator.device).unsqueeze(0)).cpu()
        if not torch.allclose(every, every[0].expand_as(every), atol=tol):
            raise AssertionError("after one step the ranks hold different weights")
    window = f", {micro} micro-batches per step" if micro > 1 else ""
    say(accelerator, f"training step ok (matches one process on the global batch of {4 * n * micro}{window}, "
                     f"tolerance {tol:g})")


def main():
    accelerator = Accelerator()
    say(accelerator, f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, "
                     f"device {accelerator.device}, mixed precision {accelerator.mixed_precision}")
    check_collectives(accelerator)
    check_sharding(accelerator)
    check_training_step(accelerator)
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
