"""The script ``hasten test`` launches: quick checks that the processes really cooperate.

1. collectives: every rank's value arrives everywhere (gather, reduce);
2. data sharding: the ranks see disjoint parts of a dataset that together make all of it;
3. one training step on N processes equals the same step on one process over the global batch.
Any mismatch raises, so the launcher reports the failing rank and exits non-zero.
"""

import copy
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator


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


def check_training_step(accelerator):
    torch.manual_seed(0)
    n = accelerator.num_processes
    model = torch.nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    x, y = torch.randn(4 * n, 4), torch.randn(4 * n, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=4))
    bx, by = next(iter(loader))
    loss = torch.nn.functional.mse_loss(model(bx), by)
    accelerator.backward(loss)
    optimizer.step()
    # The same step on one process, over the batches all ranks used.
    gx, gy = accelerator.gather(bx).cpu().float(), accelerator.gather(by).cpu().float()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(gx), gy).backward()
    ref_opt.step()
    tol = 1e-5 if accelerator.mixed_precision == "no" else 2e-2
    trained = accelerator.unwrap_model(model)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters()):
        if not torch.allclose(p.detach().cpu().float(), q.detach(), atol=tol, rtol=tol):
            raise AssertionError(f"after one step, {name} differs from the single-process step: "
                                 f"{p.detach().cpu().flatten().tolist()} vs {q.detach().flatten().tolist()}")
    flat = torch.cat([p.detach().reshape(-1).float() for p in trained.parameters()]).to(accelerator.device)
    every = accelerator.gather(flat.unsqueeze(0)).cpu()
    if not torch.allclose(every, every[0].expand_as(every), atol=tol):
        raise AssertionError("after one step the ranks hold different weights")
    say(accelerator, f"training step ok (matches one process on the global batch of {4 * n}, tolerance {tol:g})")


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
