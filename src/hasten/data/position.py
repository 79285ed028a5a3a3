"""Exact resume of a prepared loader: what it must remember besides ``(epoch, batches)``.

A pass of a torch DataLoader draws random numbers twice before any batch: the sampler's generator
(a custom sampler's shuffle) and one draw for the workers' base seed (from the loader's
``generator``, else from the *global* torch generator). Resuming mid-epoch in a new process must
replay both draws exactly as the original pass did and must not touch the global generator again
(its state was restored from the checkpoint, after those draws). So each pass records the states
of those generators as they were at its start, and a resumed pass starts from them.

Single-process loading (``num_workers=0``) looks one batch ahead only at the *indices* (to know the
last batch early), not at the data: reading a sample may draw random numbers (augmentation), and
a checkpoint saved between two steps must not have consumed the next batch's draws yet.

``load_state`` by default restarts the interrupted epoch (as Accelerate; the loop skips the trained
batches itself): the pass replays the saved states from its first batch, and reads the batches the
checkpoint already trained with the global generators set aside (``rngs_set_aside``), so that the
first untrained batch is read from the restored states, as in the uninterrupted run.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import IterableDataset

from .samplers import IterableDatasetShard

_NOTHING = object()
# Where a saved pass stood inside an iterable dataset: dropped when the epoch is played from another batch.
STREAM_POSITION_KEYS = ("dataset_state", "stream_head", "stream_pending")


class Peekable:
    """An iterator that can tell whether another item follows (by fetching it early)."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._next: Any = _NOTHING

    def __iter__(self) -> "Peekable":
        return self

    def __next__(self) -> Any:
        if self._next is not _NOTHING:
            value, self._next = self._next, _NOTHING
            return value
        return next(self._iterator)

    def has_next(self) -> bool:
        if self._next is _NOTHING:
            try:
                self._next = next(self._iterator)
            except StopIteration:
                return False
        return True


def peek_indices(iterator: Any) -> Optional[Peekable]:
    """Make a single-process torch iterator's index stream peekable (None for worker iterators)."""
    if type(iterator).__name__ != "_SingleProcessDataLoaderIter" or not hasattr(iterator, "_sampler_iter"):
        return None
    peekable = Peekable(iterator._sampler_iter)
    iterator._sampler_iter = peekable
    return peekable


def start_iterator(loader: Any, make: Callable[[], Any], resume: Optional[dict]) -> tuple[Any, Optional[torch.Tensor]]:
    """Create the torch iterator of a pass; returns it and the state its seed draw started from.

    ``resume``: the states recorded by the interrupted pass; its seed draw is replayed from them and
    the global generator is left alone.
    """
    own = loader.generator
    creates = not (getattr(loader, "persistent_workers", False) and getattr(loader, "_iterator", None) is not None)
    saved = (resume or {}).get("seed_generator_state") if creates else None
    if saved is None:
        before = (own.get_state() if own is not None else torch.get_rng_state()) if creates else None
        return make(), before
    if own is not None:
        own.set_state(saved)
        return make(), saved
    replay = torch.Generator()
    replay.set_state(saved)
    object.__setattr__(loader, "generator", replay)
    try:
        return make(), saved
    finally:
        object.__setattr__(loader, "generator", None)


def sampler_generator_state(generator: Optional[torch.Generator], resume: Optional[dict]) -> Optional[torch.Tensor]:
    """At a pass start: restore the sampler generator's state of an interrupted pass, else record it."""
    if generator is None:
        return None
    saved = (resume or {}).get("sampler_generator_state")
    if saved is not None:
        generator.set_state(saved)
        return saved
    return generator.get_state()


def sampler_seed(loader: Any) -> Optional[int]:
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    seed = getattr(sampler, "initial_seed", None)
    return int(seed) if isinstance(seed, int) else None


def sampler_epoch_seed(loader: Any) -> Optional[int]:
    """The seed the current pass of a ``SharedRandomSampler`` drew (None for other samplers)."""
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    seed = getattr(sampler, "epoch_seed", None)
    return int(seed) if isinstance(seed, int) else None


def begin_sampler_pass(loader: Any) -> None:
    """Tell a ``SharedRandomSampler`` that a pass begins (its draw comes with the first batch)."""
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    forget = getattr(sampler, "forget_pass", None)
    if forget is not None:
        forget()


def set_sampler_seed(loader: Any, seed: Optional[int], epoch_seed: Optional[int] = None) -> None:
    """Use the shuffle seed of the run that saved (a new process may have agreed on another one);
    ``epoch_seed``: the seed the interrupted pass drew, which the resumed pass uses instead of a draw."""
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if sampler is None:
        return
    if seed is not None and hasattr(sampler, "initial_seed"):
        sampler.initial_seed = int(seed)
    if hasattr(sampler, "resume_seed"):
        sampler.resume_seed = None if epoch_seed is None else int(epoch_seed)


# -- replaying the batches a checkpoint already trained ---------------------------------------------
@contextlib.contextmanager
def rngs_set_aside(seed: int) -> Iterator[None]:
    """Run the body on global generators (Python, NumPy, torch's CPU one) seeded from ``seed``, then
    put their states back, as if the body had drawn nothing (a CUDA generator in use is put back too).

    Reading a replayed batch (one the checkpoint's run already trained) must not move the
    generators the checkpoint restored: a loop that skips that batch then reads the first new batch
    from exactly the state the uninterrupted run had. The seed varies per batch, so a loop that
    trains the replayed batches still sees varied augmentation.
    """
    import random
    import sys

    numpy = sys.modules.get("numpy")  # only if the script uses it (importing it costs time)
    saved_python, saved_torch = random.getstate(), torch.get_rng_state()
    saved_numpy = numpy.random.get_state() if numpy is not None else None
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    saved_cuda = torch.cuda.get_rng_state() if cuda else None
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    # A state, not torch.manual_seed: that would also queue a seed for CUDA generators not yet made.
    torch.set_rng_state(torch.Generator().manual_seed(seed).get_state())
    try:
        yield
    finally:
        random.setstate(saved_python)
        torch.set_rng_state(saved_torch)
        if numpy is not None:
            numpy.random.set_state(saved_numpy)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda)


class ReplayedPrefix:
    """``iterator`` whose first ``count`` items are read with the global generators set aside
    (``rngs_set_aside``): the batches of an interrupted epoch that its checkpoint already trained."""

    def __init__(self, iterator: Iterator[Any], count: int, seed: int) -> None:
        self._iterator = iterator
        self._count = count
        self._seed = seed
        self._read = 0

    def __iter__(self) -> "ReplayedPrefix":
        return self

    def __next__(self) -> Any:
        if self._read >= self._count:
            return next(self._iterator)
        with rngs_set_aside(hash((self._seed, self._read)) & (2**63 - 1)):
            item = next(self._iterator)
        self._read += 1
        return item


def replayed(iterator: Iterator[Any], count: int, epoch: int) -> Iterator[Any]:
    """``iterator`` with its first ``count`` items (a restarted epoch's trained batches) read with the
    global generators set aside; ``iterator`` itself when there are none. The seeds they are read
    with come from the restored torch seed, the epoch and the process."""
    if count <= 0:
        return iterator
    from ..state import PartialState

    seed = hash((int(torch.initial_seed()), int(epoch), PartialState().process_index)) & (2**63 - 1)
    return ReplayedPrefix(iterator, count, seed)


# -- iterable datasets that can say where they are ------------------------------------------------
def stateful_stream(loader: Any) -> Optional[Any]:
    """The user's iterable dataset behind ``loader`` when it resumes through its own
    ``state_dict``/``load_state_dict`` (e.g. HF ``datasets.IterableDataset``), else None.

    Only with ``num_workers=0``: with workers the dataset objects that advance live in the worker
    processes, so this process cannot ask them where they are (those loaders resume by skipping).
    Protocol: ``state_dict()`` taken between two samples describes the position after the last
    sample read; after ``load_state_dict(state)`` the next ``iter()`` continues from there.
    """
    dataset = getattr(loader, "dataset", None)
    if getattr(loader, "num_workers", 0) or not isinstance(dataset, IterableDataset):
        return None
    if isinstance(dataset, IterableDatasetShard):
        dataset = dataset.dataset
    if callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None)):
        return dataset
    return None


def stream_snapshot(stream: Any) -> Any:
    """A copy of ``stream.state_dict()`` that later reads cannot change."""
    import copy

    return copy.deepcopy(stream.state_dict())


class StreamTracker:
    """Follows a stateful iterable dataset through a pass that reads ahead of the training loop.

    Prepared loaders read one batch (the dispatcher: one step and a batch) before handing out the
    current one. A checkpoint therefore stores the dataset's state after the *last read* batch plus
    the batches read but not yet handed out ("pending"); the resumed pass hands those out first.
    That keeps resumes bitwise exact even when reading a sample draws random numbers, since the
    saved random states already include the draws of the read-ahead.

    Batches are numbered from the start of the epoch; ``first_index``/``state``/``pending`` describe
    where a resumed pass starts.
    """

    def __init__(self, stream: Any, iterator: Iterator[Any], first_index: int = 0, state: Any = None,
                 pending: Optional[list] = None) -> None:
        self.stream, self.state = stream, state
        self._iterator = iterator
        self._replay = list(pending or ())
        self._read = list(enumerate(self._replay, start=first_index))  # (number, batch) not handed out
        self._next = first_index + len(self._replay)

    def __iter__(self) -> Iterator[Any]:
        yield from self._replay
        for batch in self._iterator:
            self.state = stream_snapshot(self.stream)
            self._read.append((self._next, batch))
            self._next += 1
            yield batch

    def point(self, handed_out: int, head: Optional[list]) -> Optional[tuple]:
        """``(dataset state, padding head, pending batches)`` once batches ``[0, handed_out)`` are
        handed out; None when the pending batches cannot be stored without pickle."""
        self._read = [(i, b) for i, b in self._read if i >= handed_out]
        pending = [b for _, b in self._read]
        if self.state is None:
            return None
        if not storable(pending):
            from ..state import warn_once

            warn_once("the batches of this iterable dataset cannot be stored in a checkpoint without pickle, so a "
                      "mid-epoch resume re-reads the epoch up to the saved position instead of restoring the "
                      "dataset's own state")
            return None
        return (self.state, padding_head(head), pending)


def storable(value: Any) -> bool:
    """True when ``value`` is made of tensors, numbers, strings, None, lists, tuples and dicts with
    string keys: what a checkpoint stores without pickle (used for the padding samples it keeps)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(storable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and storable(v) for k, v in value.items())
    return False


def padding_head(head: Optional[list]) -> Optional[list]:
    """``head`` (the first samples or batches of a pass, which pad an incomplete last step) if a
    checkpoint can keep it; else None, with a warning that a resumed run pads differently."""
    if head is None or storable(head):
        return head
    from ..state import warn_once

    warn_once("the first samples of this iterable dataset cannot be stored in a checkpoint without pickle, so a "
              "run resumed mid-epoch pads its last incomplete step with other samples than the uninterrupted run "
              "would; use drop_last=True (or even_batches=False) for bitwise resumes")
    return None
