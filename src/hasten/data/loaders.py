"""Prepared dataloaders: each process iterates its shard, batches land on the device.

``DataLoaderShard`` wraps a sharded batch sampler (map-style datasets) or a sharded iterable
dataset; ``DataLoaderDispatcher`` (in ``dispatch.py``) has process 0 read the data and send each
process its part. Both iterate one batch ahead so that ``end_of_dataloader`` is already True while
the last batch is being processed, register with ``GradientState`` while they run, and keep the
:class:`EpochPlan` that ``gather_for_metrics`` uses to drop padding.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader

from .. import progress
from ..state import GradientState
from ..utils.operations import send_to_device
from . import position
from .samplers import (
    BatchSamplerShard,
    EpochPlan,
    IterableDatasetShard,
    iterable_step_record,
)

# DataLoader settings carried from the user's loader to the prepared one (the sampling ones are
# rebuilt by the sharding).
LOADER_SETTINGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                   "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def loader_settings(dataloader: DataLoader) -> dict:
    """The user's DataLoader settings that prepared loaders keep."""
    return {key: getattr(dataloader, key) for key in LOADER_SETTINGS if hasattr(dataloader, key)}


def _sync_rng(rng_types: Optional[list], generator: Optional[torch.Generator]) -> None:
    if rng_types:
        from ..utils.random import synchronize_rng_states

        synchronize_rng_states(rng_types, generator)


def _on_cpu(data: Any) -> bool:
    """True when every tensor in ``data`` is already on the CPU (unknown objects count as not)."""
    if isinstance(data, torch.Tensor):
        return data.is_cpu
    if isinstance(data, (list, tuple, dict)):
        for value in data.values() if isinstance(data, dict) else data:
            if not _on_cpu(value):
                return False
        return True
    return data is None or isinstance(data, (str, int, float, bool))


def _accelerator_present() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return bool(torch.cuda.is_available() or (mps is not None and mps.is_available())
                or (xpu is not None and xpu.is_available()))


def place(batch: Any, device: Optional[torch.device], non_blocking: bool) -> Any:
    """``send_to_device``, skipped when it would change nothing (a CPU batch for a CPU run): moving
    is per-step overhead that matters for small models."""
    if device is None or (getattr(device, "type", None) == "cpu" and _on_cpu(batch)):
        return batch
    return send_to_device(batch, device, non_blocking=non_blocking)


class DataLoaderStateMixin:
    """Where a loader is in its pass, as the gradient state reads it (Accelerate's mixin, for loaders of one's own).

    ``end_of_dataloader``: the batch handed out last is the pass's last. ``remainder``: samples in
    the last global batch when it is short (``-1`` when unknown or with ``drop_last``). A subclass
    provides ``dataset``, ``total_batch_size``, ``_drop_last`` and ``gradient_state``, and calls
    ``begin()`` before its pass and ``end()`` after it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.end_of_dataloader = False
        cls.remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Register this loader as the running one, its remainder known when it can be."""
        self.reset()
        try:
            if not self._drop_last:
                length = getattr(self, "total_dataset_length", None)
                length = len(self.dataset) if length is None else length
                self.remainder = length % self.total_batch_size
        except (TypeError, AttributeError, ZeroDivisionError, NotImplementedError):
            pass
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        """The pass is over: the loader that ran before this one (if any) is the running one again."""
        self.gradient_state._remove_dataloader(self)


class _ItselfOnInstances:
    """``base_dataloader``: Accelerate's loaders wrap a DataLoader and name it so; hasten's prepared
    loaders are DataLoaders themselves, so an instance names itself. Read on the class it raises
    AttributeError, as the wrapped loader exists on instances only."""

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        if instance is None:
            raise AttributeError(f"{getattr(owner, '__name__', 'the class')}.base_dataloader exists on instances only")
        return instance


class PreparedLoaderMixin(DataLoaderStateMixin):
    """Epoch, resume and ``gather_for_metrics`` bookkeeping shared by the prepared loaders.

    Attributes read by ``gather_for_metrics``: ``_plan`` (the current :class:`EpochPlan`),
    ``_step`` (the plan step of the batch being processed), ``_gfm_calls`` (calls made for it),
    ``_plan_rank``, and ``end_of_dataloader``.
    """

    end_of_dataloader = False
    remainder = -1
    base_dataloader = _ItselfOnInstances()

    def _init_bookkeeping(self, rng_types: Optional[list], synchronized_generator: Optional[torch.Generator],
                          iteration: int = 0) -> None:
        self.rng_types = list(rng_types) if rng_types else None
        self.synchronized_generator = synchronized_generator
        self.iteration = iteration  # the epoch of the next (or current) pass
        self._epoch = iteration
        self._position = 0  # batches of the current epoch behind us (skipped on resume included)
        self._resume_skip = 0
        self._replay_now = 0  # ... of the current pass
        # The saved position ``restart_epoch`` replays from the epoch's start (its batches_yielded were
        # trained already), until the next pass begins; also handed to skip_first_batches.
        self._restarted: Optional[dict] = None
        self._resume_states: Optional[dict] = None  # generator states of an interrupted pass (load_state_dict)
        self._resume_now: Optional[dict] = None  # ... while the resumed pass starts
        self._pass_states: dict = {}  # generator states at the start of the current pass
        self._seed_state: Optional[torch.Tensor] = None
        self._stream_after: Optional[tuple] = None  # StreamTracker.point() of the batch handed out last
        self._in_iteration = False
        self._left_at: Optional[dict] = None  # exact_resume_state() of a pass left early (break)
        self._passes = 0  # passes begun; tells passes apart (preemption's clock)
        self._plan: Optional[EpochPlan] = None
        self._plan_rank = 0
        self._step: Optional[int] = None
        self._gfm_calls = 0
        # Called with this loader at every step boundary (see ``add_boundary_callback``).
        self._boundary_callbacks: list[Callable[[Any], None]] = []

    def add_boundary_callback(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(self)`` at every step boundary: when the loop asks for the next batch, the
        previous step being done and the next batch not yet handed out (``save_on_preemption`` saves
        there)."""
        self._boundary_callbacks.append(callback)

    def remove_boundary_callback(self, callback: Callable[[Any], None]) -> None:
        """Stop calling ``callback`` (added with ``add_boundary_callback``); no error if it is not there."""
        if callback in self._boundary_callbacks:
            self._boundary_callbacks.remove(callback)

    @property
    def gradient_state(self) -> GradientState:
        return GradientState()

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def _begin(self) -> tuple[int, int]:
        """Start a pass: sync RNGs, pick the epoch, register; returns (epoch, batches to skip)."""
        epoch, skip = self.iteration, self._resume_skip
        resume, self._resume_states = (self._resume_states or None), None
        replay = int(self._restarted["batches_yielded"]) if self._restarted is not None else 0
        self._restarted = None
        if resume is None and not replay:  # a resumed pass keeps the restored states (synced before the save)
            _sync_rng(self.rng_types, self.synchronized_generator)
        self._resume_now = resume
        self._replay_now = replay
        position.begin_sampler_pass(self)
        state = position.sampler_generator_state(self.synchronized_generator, resume)
        self._pass_states = {} if state is None else {"sampler_generator_state": state}
        self._resume_skip = 0
        self._left_at = None
        self._stream_after = None
        self._epoch, self._position, self._in_iteration = epoch, skip, True
        self._passes += 1
        self._step, self._gfm_calls = None, 0
        self.reset()
        try:
            if not self._drop_last:
                self.remainder = self.total_dataset_length % self.total_batch_size
        except (TypeError, AttributeError, ZeroDivisionError, NotImplementedError):
            pass
        self._apply_epoch(epoch)
        self.gradient_state._add_dataloader(self)
        return epoch, skip

    @contextlib.contextmanager
    def _pass(self) -> Iterator[tuple[int, int]]:
        """A pass, from ``_begin`` to ``_end``; yields (epoch, batches to skip).

        A loop that leaves early (``break``, an exception) closes the pass's generator: the pass is
        over (a new ``for`` starts the next epoch, as a plain DataLoader starts a new iteration),
        but the position it reached is kept for ``state_dict`` so that a save after the loop
        resumes at the next batch.
        """
        epoch, skip = self._begin()
        try:
            yield epoch, skip
        except GeneratorExit:
            if not self.end_of_dataloader:
                self._left_at = self.exact_resume_state()
            raise
        finally:
            self._end(epoch)

    def _end(self, epoch: int) -> None:
        self.gradient_state._remove_dataloader(self)
        self._in_iteration = False
        self._step = None
        if self.iteration == epoch:  # a set_epoch() during the pass wins
            self.iteration = epoch + 1

    def _at_boundary(self) -> None:
        """A step boundary: the last batch is done, the next one not handed out (preemption saves here)."""
        callbacks = self._boundary_callbacks
        if callbacks:
            for callback in list(callbacks):
                callback(self)

    def _at_step(self, step: int, last: bool) -> None:
        """Bookkeeping just before a batch is handed to the user."""
        plan = self._plan
        if plan is not None and plan.records:
            plan.forget_before(step)
        # Straight into __dict__: DataLoader.__setattr__ is a Python-level check run on every
        # assignment, which adds up to microseconds per step for small models.
        attrs = self.__dict__
        if last:
            attrs["end_of_dataloader"] = True
        attrs["_step"], attrs["_gfm_calls"] = step, 0
        attrs["_position"] += 1

    def _mover(self) -> Optional[Callable[[Any], Any]]:
        """How batches reach ``self.device`` this pass; None when they are there already (a CPU run
        on a machine without accelerators: every tensor is a CPU tensor)."""
        device = self.device
        if device is None or (getattr(device, "type", None) == "cpu" and not _accelerator_present()):
            return None
        non_blocking = self._non_blocking
        return lambda batch: place(batch, device, non_blocking)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch`` (shuffle order, dataset epoch) from the next pass on."""
        self.iteration = int(epoch)
        self._left_at = None
        self._apply_epoch(int(epoch))

    def _epoch_targets(self) -> list:
        holders = [self.batch_sampler, self.__dict__.get("sampler")]
        return holders + [getattr(h, "sampler", None) for h in holders] + [self.dataset]

    def _apply_epoch(self, epoch: int) -> None:
        seen: list = []
        for target in self._epoch_targets():
            if target is not None and hasattr(target, "set_epoch") and not any(target is s for s in seen):
                seen.append(target)
                target.set_epoch(epoch)

    # -- checkpoint seam: where in which epoch we are ------------------------------------------------
    def state_dict(self) -> dict:
        """``{"epoch", "batches_yielded"}``: where the next pass should start (exact resume)."""
        if self._in_iteration and not self.end_of_dataloader:
            return {"epoch": self._epoch, "batches_yielded": self._position}
        if self._left_at is not None:
            return {key: self._left_at[key] for key in ("epoch", "batches_yielded")}
        if self._in_iteration:
            return {"epoch": self._epoch + 1, "batches_yielded": 0}
        pending = self.pending_resume_state()  # restored, not iterated since: a save keeps that position
        if pending is not None:
            return {"epoch": pending["epoch"], "batches_yielded": pending["batches_yielded"]}
        return {"epoch": self.iteration, "batches_yielded": 0}

    def exact_resume_state(self) -> dict:
        """``state_dict()`` plus the shuffle seed and, mid-epoch, the generator states the pass started
        from (``data/position.py``), so that a resumed pass draws exactly what the interrupted one drew.
        ``load_state_dict`` accepts either."""
        if not self._in_iteration and self._left_at is not None:
            return dict(self._left_at)
        pending = None if self._in_iteration else self.pending_resume_state()
        if pending is not None:
            return dict(pending, sampler_seed=position.sampler_seed(self))
        out = dict(self.state_dict(), sampler_seed=position.sampler_seed(self))
        if self._in_iteration and not self.end_of_dataloader:
            out.update(self._pass_states)
            epoch_seed = position.sampler_epoch_seed(self)
            if epoch_seed is not None:
                out["sampler_epoch_seed"] = epoch_seed
            if self._seed_state is not None:
                out["seed_generator_state"] = self._seed_state
            if self._stream_after is not None:
                out["dataset_state"], head, out["stream_pending"] = self._stream_after
                if head is not None:
                    out["stream_head"] = head
        return out

    def pending_resume_state(self) -> Optional[dict]:
        """The interrupted epoch that ``load_state_dict`` or ``restart_epoch`` restored and no pass has
        used yet (None: nothing pending), in the form ``load_state_dict`` takes (it continues at the
        saved batch): hands that epoch to ``skip_first_batches``' loader."""
        if self._restarted is not None:
            return dict(self._restarted)
        if not self._resume_skip:
            return None
        sampler = self.get_sampler()
        epoch_seed = getattr(sampler, "resume_seed", None)
        state = dict(self._resume_states or {}, epoch=self.iteration, batches_yielded=self._resume_skip)
        return state if epoch_seed is None else dict(state, sampler_epoch_seed=int(epoch_seed))

    def load_state_dict(self, state_dict: dict) -> None:
        """Make the next pass run epoch ``state_dict["epoch"]`` from batch ``batches_yielded`` on
        (continue where the saved pass stood, as a stateful loader does)."""
        self.iteration = int(state_dict.get("epoch", 0))
        self._left_at = None
        self._resume_skip = int(state_dict.get("batches_yielded", 0))
        self._restarted = None
        keys = ("seed_generator_state", "sampler_generator_state", *position.STREAM_POSITION_KEYS)
        self._resume_states = {k: state_dict[k] for k in keys if state_dict.get(k) is not None}
        position.set_sampler_seed(self, state_dict.get("sampler_seed"), state_dict.get("sampler_epoch_seed"))

    def restart_epoch(self, state_dict: dict) -> None:
        """Make the next pass run epoch ``state_dict["epoch"]`` (a ``state_dict()``) again from its first
        batch, with the order and generator states the saved pass had: what ``load_state`` does by
        default, so that a loop that skips the first ``batches_yielded`` batches itself (or
        ``skip_first_batches``) lands on the batches the saved run had not trained yet.

        Those first batches are read with the global generators set aside
        (``position.rngs_set_aside``): skipping them leaves the restored generators as they were, so
        the rest of the epoch equals the uninterrupted run's exactly. The next pass is the next epoch.
        """
        done = int(state_dict.get("batches_yielded", 0))
        self.load_state_dict(state_dict)
        if not done:
            return
        self._resume_skip = 0
        self._restarted = dict(state_dict)
        # Where the saved pass stood inside an iterable dataset: not wanted when the epoch starts again.
        for key in position.STREAM_POSITION_KEYS:
            self._resume_states.pop(key, None)

    @property
    def takes_even_batches(self) -> bool:
        """Whether ``set_even_batches`` changes anything (not for an iterable dataset's shards)."""
        return isinstance(getattr(self, "_shard", None), BatchSamplerShard) or hasattr(self, "even_batches")

    def set_even_batches(self, even_batches: bool) -> None:
        """Switch even_batches for the next pass (``Accelerator.join_uneven_inputs``)."""
        shard = getattr(self, "_shard", None)
        if isinstance(shard, BatchSamplerShard):
            shard.even_batches = even_batches
        if hasattr(self, "even_batches"):
            self.even_batches = even_batches

    @property
    def total_dataset_length(self) -> int:
        return getattr(self.dataset, "total_length", None) or len(self.dataset)

    def get_sampler(self) -> Any:
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        holder = self.batch_sampler if self.batch_sampler is not None else self.sampler
        holder.sampler = sampler
        if getattr(self, "_public_sampler", False):
            object.__setattr__(self, "sampler", sampler)


class _TaggedCollate:
    """Collates samples of a tagged ``IterableDatasetShard`` and passes the group's real count on."""

    def __init__(self, collate_fn: Callable, auto_collation: bool) -> None:
        self.collate_fn = collate_fn
        self.auto_collation = auto_collation

    def __call__(self, items: Any) -> tuple:
        if self.auto_collation:
            return self.collate_fn([item for item, _ in items]), items[0][1]
        item, group_real = items
        return self.collate_fn(item), group_real


class DataLoaderShard(PreparedLoaderMixin, DataLoader):
    """A DataLoader over one process's shard, moving each batch to ``device``.

    Args:
        dataset: the dataset (an :class:`IterableDatasetShard` for sharded iterable datasets).
        device: where batches go (``send_to_device``); None leaves them where the collate put them.
        rng_types: RNGs copied from process 0 at the start of each pass ("torch", "cuda", "xpu",
            "generator": ``synchronized_generator``).
        skip_batches: batches to skip at the start of every pass.
        **kwargs: ``torch.utils.data.DataLoader`` arguments (``batch_sampler`` a
            :class:`BatchSamplerShard` for map-style datasets).

    Attributes: ``end_of_dataloader`` (True while the last batch is processed), ``remainder``,
    ``total_batch_size``, ``total_dataset_length``, ``batch_size`` (per process), ``iteration``
    (the epoch of the next pass).
    """

    def __init__(self, dataset: Any, device: Optional[torch.device] = None, rng_types: Optional[list] = None,
                 synchronized_generator: Optional[torch.Generator] = None, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 iteration: int = 0, **kwargs: Any) -> None:
        self._tagged = isinstance(dataset, IterableDatasetShard) and dataset._tagged
        if self._tagged:
            auto = kwargs.get("batch_size", 1) is not None
            collate = kwargs.get("collate_fn")
            if collate is None:
                from torch.utils.data._utils.collate import default_collate, default_convert

                collate = default_collate if auto else default_convert
            if not isinstance(collate, _TaggedCollate):
                kwargs["collate_fn"] = _TaggedCollate(collate, auto)
        super().__init__(dataset, **kwargs)
        self.device = device
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self._init_bookkeeping(rng_types, synchronized_generator, iteration)
        # Make the public attributes describe the sharded loader rather than torch's placeholders.
        shard = self._shard
        if shard is not None and self.batch_sampler is shard:
            object.__setattr__(self, "sampler", shard.sampler)
            self._public_sampler = True
        if shard is not None:
            size = shard.batch_size
            object.__setattr__(self, "batch_size", size // shard.num_processes if size and shard.split_batches else size)

    @property
    def _shard(self) -> Optional[BatchSamplerShard]:
        for candidate in (self.batch_sampler, self.__dict__.get("sampler")):
            if isinstance(candidate, BatchSamplerShard):
                return candidate
        return None

    @property
    def collate_fn_user(self) -> Callable:
        """The collate function the user gave (prepared iterable loaders wrap it)."""
        return getattr(self.collate_fn, "collate_fn", self.collate_fn)

    @property
    def total_batch_size(self) -> int:
        shard = self._shard
        if shard is not None:
            return shard.batch_size if shard.split_batches else shard.batch_size * shard.num_processes
        ds = self.dataset
        if isinstance(ds, IterableDatasetShard) and ds.batch_size is not None:
            return ds.batch_size if ds.split_batches else ds.batch_size * ds.num_processes
        return self.batch_size

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        with self._pass() as (_, skip):
            shard = self._shard
            if shard is not None:  # map-style: skip indices, never data
                shard._skip_next = max(0, skip - shard.skip_batches)
                skip_here = 0
                self._position = max(skip, shard.skip_batches)
            elif self._resume_stream(skip):  # the dataset continues from its saved position
                skip_here = 0
            else:
                skip_here = max(skip, self.skip_batches)
                self._position = skip_here
            iterator, seed_state = position.start_iterator(self, lambda: DataLoader.__iter__(self), self._resume_now)
            if seed_state is not None:
                self._seed_state = seed_state
            if shard is not None:
                shard._skip_next = 0
                self._plan, self._plan_rank = shard.current_plan, shard.process_index
            elif self._tagged:
                self._plan, self._plan_rank = EpochPlan(self.dataset.num_processes), self.dataset.process_index
            else:
                self._plan = None
            yield from self._run(iterator, skip_here)

    def _unwrap(self, batch: Any) -> Any:
        if not self._tagged:
            return batch
        batch, group_real = batch
        ds = self.dataset
        record = iterable_step_record(int(group_real), ds.batch_size, ds.num_processes, ds.split_batches)
        self._plan.add(record.sizes, record.real)
        return batch

    def _run(self, iterator: Iterator[Any], skip: int) -> Iterator[Any]:
        peek = position.peek_indices(iterator) if self._shard is not None and not skip else None
        iterator = position.replayed(iterator, self._replay_now, self._epoch)
        if peek is not None:
            yield from self._run_lazily(iterator, peek)
            return
        stream, move = position.stateful_stream(self), self._mover()
        tracker, base = None, 0
        if stream is not None:
            state, _, pending = self._stream_after or (None, None, None)
            base = self._position if state is not None else 0  # batches of the epoch handed out before
            tracker = position.StreamTracker(stream, iterator, base, state, pending)
            iterator = iter(tracker)
        try:
            current = progress.fetch(iterator)
        except StopIteration:
            self._finish_plan()
            return
        step = 0
        while True:
            current = self._unwrap(current)
            if step >= skip and move is not None:
                current = move(current)
            try:
                upcoming, last = progress.fetch(iterator), False
            except StopIteration:
                upcoming, last = None, True
                self._finish_plan()
            if step >= skip:
                self._at_boundary()
                self._at_step(step, last)
                if tracker is not None:
                    self._stream_after = tracker.point(base + step + 1, self._padding_head())
                yield current
            if last:
                return
            current, step = upcoming, step + 1

    def _resume_stream(self, skip: int) -> bool:
        """Resume an iterable dataset through its own ``load_state_dict`` (no batch is re-read)."""
        resume = self._resume_now or {}
        stream = position.stateful_stream(self)
        if stream is None or resume.get("dataset_state") is None:
            return False
        state, head = resume["dataset_state"], resume.get("stream_head")
        if isinstance(self.dataset, IterableDatasetShard):
            self.dataset._resume = (state, head)  # loaded by the shard once its epoch seed is set
        else:
            stream.load_state_dict(state)
        self._position = skip
        self._stream_after = (state, head, list(resume.get("stream_pending") or ()))
        return True

    def _padding_head(self) -> Optional[list]:
        """The first group of the pass, kept in checkpoints when it may pad the last group."""
        ds = self.dataset
        if not isinstance(ds, IterableDatasetShard) or ds.num_processes == 1 or ds.drop_last or ds.head is None:
            return None
        return ds.head

    def _run_lazily(self, iterator: Iterator[Any], peek: position.Peekable) -> Iterator[Any]:
        """``num_workers=0``: read each batch only when it is asked for; peek at indices for the end."""
        step, move = 0, self._mover()
        while True:
            self._at_boundary()
            try:
                current = progress.fetch(iterator)
            except StopIteration:
                return
            last = not peek.has_next()
            if move is not None:
                current = move(current)
            self._at_step(step, last)
            yield current
            if last:
                return
            step += 1

    def _finish_plan(self) -> None:
        if self._tagged and self._plan is not None:
            self._plan.finish()


class SkipDataLoader(PreparedLoaderMixin, DataLoader):
    """A DataLoader that skips its first ``skip_batches`` batches (by reading them)."""

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches
        self._drop_last = kwargs.get("drop_last", False)
        self._init_bookkeeping(None, None)

    @property
    def total_batch_size(self) -> int:
        return self.batch_size

    def __iter__(self) -> Iterator[Any]:
        with self._pass():
            for index, batch in enumerate(super().__iter__()):
                if index >= self.skip_batches:
                    self._position += 1
                    yield batch

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)


def get_sampler(dataloader: DataLoader) -> Any:
    """The index sampler inside ``dataloader`` (inside its batch sampler), or None."""
    for holder in (dataloader.batch_sampler, dataloader.__dict__.get("sampler")):
        if isinstance(holder, BatchSampler) or isinstance(holder, BatchSamplerShard):
            return getattr(holder, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)
