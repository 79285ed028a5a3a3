"""``prepare_data_loader`` (shard a user's DataLoader) and ``skip_first_batches``."""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from ..state import PartialState, data_parallel as current_data_parallel
from ..topology import DataParallel
from ..utils.operations import broadcast_object_list
from .loaders import DataLoaderShard, SkipDataLoader, _TaggedCollate, loader_settings
from .order import SeedableRandomSampler, SharedRandomSampler
from .samplers import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler


# -- prepare ----------------------------------------------------------------------------------------
def _process_zero_seed(seed: int) -> int:
    """Process 0's ``seed`` on every process (a broadcast when processes run)."""
    if not PartialState().use_distributed:
        return int(seed)
    box = [int(seed)]
    broadcast_object_list(box, from_process=0)
    return int(box[0])


def _shuffling(batch_sampler: Any, use_seedable_sampler: bool, data_seed: Optional[int],
               agree: bool) -> tuple[Any, bool]:
    """A copy of ``batch_sampler`` whose ``RandomSampler`` is replaced so that every process walks one
    order; returns it and whether it was replaced.

    ``use_seedable_sampler``: a :class:`SeedableRandomSampler` seeded by ``data_seed``, else process
    0's ``torch.initial_seed()`` (Accelerate's order: seed + epoch). Otherwise a ``RandomSampler``
    without a generator becomes a :class:`SharedRandomSampler` (the plain DataLoader's order, process
    0's draw; ``agree``: broadcast it); one with the user's generator is kept (synchronised through
    ``rng_types``).
    """
    inner = getattr(batch_sampler, "sampler", None)
    if not isinstance(inner, RandomSampler) or isinstance(inner, (SeedableRandomSampler, SharedRandomSampler)):
        return batch_sampler, False
    if use_seedable_sampler:
        seed = data_seed if data_seed is not None else _process_zero_seed(torch.initial_seed())
        sampler: RandomSampler = SeedableRandomSampler(inner.data_source, replacement=inner.replacement,
                                                       num_samples=inner._num_samples, generator=inner.generator,
                                                       data_seed=seed)
    elif inner.generator is not None:
        # The user's generator draws the order, as in a plain DataLoader (re-seeding it before an
        # epoch repeats that epoch's order); the "generator" RNG type keeps it equal on every process.
        return batch_sampler, False
    else:
        sampler = SharedRandomSampler(inner.data_source, replacement=inner.replacement,
                                      num_samples=inner._num_samples, agree=_process_zero_seed if agree else None)
    new = copy.copy(batch_sampler)
    new.sampler = sampler
    return new, True


def _check_split(dataloader: DataLoader, num_processes: int) -> None:
    size = dataloader.batch_size
    if size is None:
        size = getattr(dataloader.batch_sampler, "batch_size", None) or getattr(dataloader.sampler, "batch_size", None)
    if size is None:
        raise ValueError(
            "split_batches=True needs the global batch size to split, but the DataLoader has batch_size=None and "
            "its batch sampler has no `batch_size` attribute; give it one or use split_batches=False"
        )
    if size % num_processes != 0:
        raise ValueError(
            f"split_batches=True cuts each batch of {size} samples into {num_processes} equal parts, but {size} is "
            f"not a round multiple of {num_processes}; use a batch size that is a multiple of the number of processes "
            "or split_batches=False"
        )


def prepare_data_loader(
    dataloader: DataLoader,
    device: Optional[torch.device] = None,
    num_processes: Optional[int] = None,
    process_index: Optional[int] = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Optional[list] = None,
    dispatch_batches: Optional[bool] = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Optional[Callable] = None,
    use_seedable_sampler: bool = False,
    data_seed: Optional[int] = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    *,
    data_parallel: Optional[DataParallel] = None,
) -> DataLoader:
    """Shard ``dataloader`` across processes; returns a ``DataLoaderShard`` or ``DataLoaderDispatcher``.

    Map-style datasets: batch ``i`` goes to process ``i % num_processes`` (``split_batches``: every
    batch is cut into equal parts). ``even_batches`` completes the end with samples from the start
    so that every process gets as many batches, all full; ``gather_for_metrics`` drops those
    duplicates again. Iterable datasets: every process reads the stream and keeps its slice of each
    group of ``num_processes`` batches (the last group completed from the start unless
    ``drop_last``); with ``dispatch_batches`` (default: iterable dataset and ``put_on_device``)
    process 0 reads the data and sends each process its part instead.

    Shuffling keeps the plain DataLoader's order, sharded: a ``RandomSampler`` without a generator
    of its own is replaced by a :class:`SharedRandomSampler`, which draws each epoch's seed from the
    global generator as ``RandomSampler`` does and uses process 0's draw on every process (so with
    one process the batches are those of the unprepared loader, and N processes share that global
    order). A sampler with the user's ``generator`` keeps drawing from it, as in a plain DataLoader;
    ``rng_types`` with "generator" copies its state from process 0 at every pass.
    ``use_seedable_sampler``: a :class:`SeedableRandomSampler` instead (order from ``data_seed``,
    else process 0's ``torch.initial_seed()``, plus the epoch), as in Accelerate; ``data_seed`` has no
    effect without it. Custom samplers and batch samplers are kept. The dataset, collate_fn, workers
    and other DataLoader settings are kept. ``use_stateful_dataloader`` is accepted for
    compatibility: prepared loaders always have
    ``state_dict``/``load_state_dict``. ``data_parallel`` (hasten's): the data-parallel view to shard
    over (the Accelerator passes its strategy's); default: the running Accelerator's.
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader needs a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    state = PartialState()
    # Tensor-parallel ranks of one replica read the same batches: the Accelerator passes its
    # strategy's data-parallel view; called directly, the view of the running Accelerator, if any.
    dp = data_parallel if data_parallel is not None else current_data_parallel()
    num_processes = dp.size if num_processes is None else int(num_processes)
    process_index = dp.rank if process_index is None else int(process_index)
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index={process_index} is not in [0, num_processes={num_processes})")
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if dispatch_batches is None:
        dispatch_batches = bool(put_on_device and iterable)
    if dispatch_batches and not put_on_device:
        raise ValueError("dispatch_batches=True sends batches to the device: pass put_on_device=True as well "
                         "(or dispatch_batches=False)")
    if split_batches:
        _check_split(dataloader, num_processes)
    rng_types = list(rng_types) if rng_types else []
    settings = loader_settings(dataloader)
    synchronized_generator = None

    sampler_is_batch_sampler = not iterable and isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = None
    if not iterable:
        batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
        if batch_sampler is None:
            raise ValueError(
                "prepare_data_loader cannot shard a map-style DataLoader built with batch_size=None and a plain "
                "sampler (it yields single samples); give it a batch_size, or a batch sampler as `sampler`"
            )
        if data_seed is not None and not use_seedable_sampler:
            from ..state import warn_once

            warn_once(f"data_seed={data_seed} only seeds the shuffle together with use_seedable_sampler=True (as in "
                      "Accelerate); without it a shuffling DataLoader keeps the order the plain DataLoader has")
        # Only process 0 walks the batch sampler of a dispatching loader: nothing to agree on then.
        batch_sampler, replaced = _shuffling(batch_sampler, use_seedable_sampler, data_seed,
                                             agree=not dispatch_batches)
        if not replaced:
            synchronized_generator = getattr(getattr(batch_sampler, "sampler", None), "generator", None)
    else:
        synchronized_generator = getattr(dataset, "generator", None)
    if not isinstance(synchronized_generator, torch.Generator):
        synchronized_generator = None
    if synchronized_generator is None and "generator" in rng_types:
        rng_types.remove("generator")

    if dispatch_batches:
        from .dispatch import DataLoaderDispatcher

        if (num_processes, process_index) != (dp.size, dp.rank):
            raise ValueError(
                f"dispatch_batches=True sends data between the data-parallel processes ({dp.size}); "
                f"num_processes={num_processes}/process_index={process_index} do not match them"
            )
        kwargs: dict[str, Any] = dict(settings)
        if iterable:
            kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
        elif sampler_is_batch_sampler:
            kwargs.update(sampler=batch_sampler, batch_size=None)
        else:
            kwargs.update(batch_sampler=batch_sampler)
        return DataLoaderDispatcher(
            dataset, split_batches=split_batches, even_batches=even_batches, _drop_last=dataloader.drop_last,
            _non_blocking=non_blocking, slice_fn=slice_fn_for_dispatch,
            device=device if device is not None else state.device,
            use_stateful_dataloader=use_stateful_dataloader, rng_types=rng_types,
            synchronized_generator=synchronized_generator, data_parallel=dp, **kwargs)

    kwargs = dict(settings)
    if iterable:
        size = dataloader.batch_size
        if num_processes > 1:
            dataset = IterableDatasetShard(dataset, batch_size=size, drop_last=dataloader.drop_last,
                                           num_processes=num_processes, process_index=process_index,
                                           split_batches=split_batches)
            dataset._tagged = True
        if split_batches and size is not None:
            size //= num_processes
        kwargs.update(batch_size=size, drop_last=dataloader.drop_last)
    else:
        shard = BatchSamplerShard(batch_sampler, num_processes=num_processes, process_index=process_index,
                                  split_batches=split_batches, even_batches=even_batches,
                                  pad_lone_step=True)  # a loop's collectives need a batch on every process
        if sampler_is_batch_sampler:
            kwargs.update(sampler=shard, batch_size=None)
        else:
            kwargs.update(batch_sampler=shard)
    return DataLoaderShard(
        dataset, device=device if put_on_device else None, rng_types=rng_types,
        synchronized_generator=synchronized_generator, use_stateful_dataloader=use_stateful_dataloader,
        _drop_last=dataloader.drop_last, _non_blocking=non_blocking, **kwargs)


def _own_sampling(dataloader: DataLoader) -> dict:
    """The sampling arguments of a loader built by hand (not sharded by ``prepare``), for a copy.

    Its own (batch) sampler is kept, not rebuilt from ``batch_size``: a custom batch sampler, or a
    sampler whose epoch was set, must go on drawing the same order.
    """
    if dataloader.batch_size is None and dataloader.batch_sampler is not None:
        return {"batch_sampler": dataloader.batch_sampler}
    out = {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last}
    if not isinstance(dataloader.dataset, IterableDataset):
        out["sampler"] = dataloader.sampler
    return out


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader like ``dataloader`` whose passes start after its first ``num_batches`` batches.

    Map-style loaders skip at the batch-sampler level (indices only: no sample is read); iterable
    ones have to read and drop the skipped batches. A prepared loader gives a prepared loader of
    the same kind, with the same epoch.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches={num_batches} must be >= 0")
    from .dispatch import DataLoaderDispatcher

    if isinstance(dataloader, DataLoaderDispatcher):
        return dataloader._with_skip(num_batches)
    settings = loader_settings(dataloader)
    if isinstance(dataloader, DataLoaderShard):
        kwargs: dict[str, Any] = dict(settings)
        shard = dataloader._shard
        common = dict(device=dataloader.device, rng_types=dataloader.rng_types,
                      synchronized_generator=dataloader.synchronized_generator,
                      use_stateful_dataloader=dataloader.use_stateful_dataloader, _drop_last=dataloader._drop_last,
                      _non_blocking=dataloader._non_blocking, iteration=dataloader.iteration)
        if shard is not None:
            new_shard = copy.copy(shard)
            new_shard.skip_batches = shard.skip_batches + num_batches
            new_shard._skip_next, new_shard.current_plan = 0, None
            if dataloader.batch_sampler is shard:
                kwargs.update(batch_sampler=new_shard)
            else:
                kwargs.update(sampler=new_shard, batch_size=None)
            return DataLoaderShard(dataloader.dataset, **common, **kwargs)
        kwargs.update(_own_sampling(dataloader))
        if isinstance(kwargs.get("collate_fn"), _TaggedCollate):
            kwargs["collate_fn"] = kwargs["collate_fn"].collate_fn
        return DataLoaderShard(dataloader.dataset, skip_batches=dataloader.skip_batches + num_batches,
                               **common, **kwargs)
    if isinstance(dataloader.dataset, IterableDataset):
        return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, batch_size=dataloader.batch_size,
                              drop_last=dataloader.drop_last, **settings)
    if isinstance(dataloader.sampler, BatchSampler):
        return DataLoader(dataloader.dataset, sampler=SkipBatchSampler(dataloader.sampler, num_batches),
                          batch_size=None, **settings)
    return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
                      **settings)
