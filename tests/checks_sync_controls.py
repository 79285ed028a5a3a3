"""Gradient-sync controls of a prepared DDP model, run inside each of 2 ranks (see distributed.py)."""

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _spread(acc, tensor):
    """Every process's copy of ``tensor`` (to see whether the gradients were synchronised)."""
    return acc.gather(tensor.unsqueeze(0)).tolist()


def check_trigger_sync_in_backward_is_a_context_manager():
    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(nn.Linear(3, 1))
    x = torch.full((2, 3), float(acc.process_index + 1), device=acc.device)  # different data on each process
    with acc.no_sync(model):
        with acc.trigger_sync_in_backward(model):
            acc.backward(model(x).sum())
        synced = _spread(acc, _grads(model))
        model.zero_grad()
        acc.backward(model(x).sum())  # after the block: no_sync again
        local = _spread(acc, _grads(model))
    assert synced[0] == synced[-1], synced  # averaged over the processes
    assert local[0] != local[-1], local  # the flags were restored
    return synced[0]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10.0))


def _counts(*loaders):
    return [sum(1 for _ in dl) for dl in loaders]


def check_join_uneven_inputs_warns_instead_of_failing():
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=None))
    mapped = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2)  # 5 batches: 3 + 2 when uneven
    model, mapped, dispatched = acc.prepare(nn.Linear(1, 1), mapped, DataLoader(Stream(), batch_size=2))
    seen = {"before": _counts(mapped, dispatched)}
    with acc.join_uneven_inputs([model], even_batches=False):
        seen["inside"] = _counts(mapped, dispatched)
    seen["after"] = _counts(mapped, dispatched)
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    sharded = acc.prepare(DataLoader(Stream(), batch_size=2))  # each process reads its own share
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acc.join_uneven_inputs([model], even_batches=False):
            pass
    seen["iterable warned"] = any("shard an iterable dataset" in str(w.message) for w in caught)
    acc.strategy.supports_join = False  # as a strategy without torch's Join (FSDP, DeepSpeed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acc.join_uneven_inputs([model]):
            seen["sharded"] = _counts(sharded)
    seen["other strategy warned"] = any("DistributedDataParallel only" in str(w.message) for w in caught)
    return seen
