"""The order in which a sampler walks a dataset: the seeded shuffle that every process agrees on,
and computing a whole epoch's order at once, so that a resumed pass starts at its position
directly instead of walking the skipped indices (``BatchSamplerShard`` uses ``seek_batches``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler


# -- shuffling ------------------------------------------------------------------------------------
class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order is a function of ``initial_seed + epoch`` only.

    Every process that builds it with the same seed walks the same permutation, and a new epoch
    (``set_epoch``, or each completed pass) gives a new one, reproducibly.

    Args:
        data_source, replacement, num_samples, generator: as ``torch.utils.data.RandomSampler``.
        data_seed: the seed; default: ``generator.initial_seed()`` when a generator is given, else
            ``torch.initial_seed()`` (``prepare_data_loader`` makes it agree across processes).
    """

    def __init__(self, data_source: Any, replacement: bool = False, num_samples: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, data_seed: Optional[int] = None) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        if data_seed is not None:
            self.initial_seed = int(data_seed)
        elif generator is not None:
            self.initial_seed = int(generator.initial_seed())
        else:
            self.initial_seed = int(torch.initial_seed())
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        generator = torch.Generator()
        generator.manual_seed(self.initial_seed + epoch)
        self.generator = generator  # RandomSampler's own algorithm then draws from it
        yield from super().__iter__()
        self.epoch = epoch + 1

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` from the next iteration on."""
        self.epoch = int(epoch)



# -- seeking without walking the skipped indices ----------------------------------------------------
def fast_order(sampler: Any) -> Optional[Callable[[], Any]]:
    """For samplers whose whole order can be computed at once: a function returning it (a list or
    range) with the same side effects as iterating the sampler; None for other samplers.

    Covers ``SequentialSampler`` and ``SeedableRandomSampler`` without replacement; resuming with
    them costs one permutation, wherever in the epoch the resume lands.
    """
    if type(sampler) is SequentialSampler:
        return lambda: range(len(sampler.data_source))
    if type(sampler) is SeedableRandomSampler and not sampler.replacement:
        n = len(sampler.data_source)
        if sampler.num_samples != n:
            return None

        def order() -> list:
            # What RandomSampler.__iter__ yields for num_samples == len(data_source): one permutation
            # drawn from the epoch's generator (checked against the sampler itself in the tests).
            epoch = sampler.epoch
            generator = torch.Generator()
            generator.manual_seed(sampler.initial_seed + epoch)
            sampler.generator = generator
            indices = torch.randperm(n, generator=generator).tolist()
            sampler.epoch = epoch + 1
            return indices

        return order
    return None


def seek_batches(batch_sampler: Any, first: int, head_count: int) -> Optional[tuple[list, Iterator[list]]]:
    """``(first head_count batches, batches from number first on)`` of a plain ``BatchSampler``
    computed from its sampler's order in one go; None when that is not possible."""
    if type(batch_sampler) is not BatchSampler:
        return None
    order_fn = fast_order(batch_sampler.sampler)
    if order_fn is None:
        return None
    order = order_fn()
    size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
    head = [list(order[i * size:(i + 1) * size]) for i in range(head_count)]
    head = [b for b in head if b and (len(b) == size or not drop_last)]

    def rest() -> Iterator[list]:
        for start in range(first * size, len(order), size):
            batch = list(order[start:start + size])
            if len(batch) < size and drop_last:
                return
            yield batch

    return head, rest()
