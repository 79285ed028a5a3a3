"""The order in which a sampler walks a dataset: the shuffles that every process agrees on,
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
        data_seed: the seed; default: ``torch.initial_seed()``, as Accelerate's (a given ``generator``
            is not drawn from; ``prepare_data_loader`` makes the seed agree across processes).
    """

    def __init__(self, data_source: Any, replacement: bool = False, num_samples: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, data_seed: Optional[int] = None) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        self.initial_seed = int(data_seed) if data_seed is not None else int(torch.initial_seed())
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


class SharedRandomSampler(RandomSampler):
    """A ``RandomSampler`` (without a generator of its own) whose every process walks the order that
    process 0's plain ``RandomSampler`` would have walked.

    Each pass draws its seed from the global torch generator exactly as ``RandomSampler`` does (same
    draw, at the same moment: the first index asked for), so with one process the order, and what
    is left of the global generator, are those of the unprepared DataLoader. ``agree`` then replaces
    the seed by process 0's (a broadcast), so every process shuffles alike even when the user's
    global generators differ. ``resume_seed`` (set from a checkpoint) is used by the next pass
    instead of a draw: the restored global generator is already past that pass's draw.

    Args:
        data_source, replacement, num_samples: as ``torch.utils.data.RandomSampler``.
        agree: ``seed -> process 0's seed``; None: this process decides alone.
    """

    def __init__(self, data_source: Any, replacement: bool = False, num_samples: Optional[int] = None,
                 agree: Optional[Callable[[int], int]] = None) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        self.agree = agree
        self.epoch_seed: Optional[int] = None  # the seed of the current (or last) pass
        self.resume_seed: Optional[int] = None

    def forget_pass(self) -> None:
        """A new pass has begun and has not drawn yet: the last pass's seed no longer describes it (a
        save between now and the draw must let the resumed pass draw, from the restored generator)."""
        self.epoch_seed = None

    def next_generator(self) -> torch.Generator:
        """The generator of a new pass (draws from the global generator unless resuming)."""
        seed, self.resume_seed = self.resume_seed, None
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())  # RandomSampler's own draw
            if self.agree is not None:
                seed = int(self.agree(seed))
        self.epoch_seed = seed
        generator = torch.Generator()
        generator.manual_seed(seed)
        return generator

    def __iter__(self) -> Iterator[int]:
        self.generator = self.next_generator()
        try:
            yield from super().__iter__()
        finally:
            self.generator = None  # the next pass draws a new seed, as a plain RandomSampler does


# -- seeking without walking the skipped indices ----------------------------------------------------
def fast_order(sampler: Any) -> Optional[Callable[[], Any]]:
    """For samplers whose whole order can be computed at once: a function returning it (a list or
    range) with the same side effects as iterating the sampler; None for other samplers.

    Covers ``SequentialSampler``, ``SeedableRandomSampler`` and ``SharedRandomSampler`` without
    replacement; resuming with them costs one permutation, wherever in the epoch the resume lands.
    """
    if type(sampler) is SequentialSampler:
        return lambda: range(len(sampler.data_source))
    if type(sampler) is SharedRandomSampler and not sampler.replacement:
        n = len(sampler.data_source)
        if sampler.num_samples != n:
            return None
        # What RandomSampler.__iter__ yields for num_samples == len(data_source): one permutation.
        return lambda: torch.randperm(n, generator=sampler.next_generator()).tolist()
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
