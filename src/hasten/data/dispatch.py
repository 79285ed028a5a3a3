"""``DataLoaderDispatcher``: process 0 reads the data and sends every process its part.

Process 0 groups the batches of the real loader exactly as the sharded path would (without
``split_batches``: N consecutive batches, one per process; with it: one batch cut into N parts),
completes the last group with rows from the first one when ``even_batches``, and broadcasts, for
every step, an outline (structure, shapes, dtypes, non-tensor values, per-process sizes and real
counts) followed by the tensors. The other processes never touch the dataset. The exchange of step
``t + 1`` happens before step ``t`` is handed to the user, so every process knows, while
processing a batch, whether it is its last one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ..state import PartialState, data_parallel as current_data_parallel
from ..topology import DataParallel
from ..utils.operations import broadcast, broadcast_object_list, honor_type
from . import position
from .loaders import PreparedLoaderMixin
from .samplers import EpochPlan, count_steps, split_steps, whole_steps


# -- rows of nested batches -------------------------------------------------------------------------
def _is_row_list(data: Any) -> bool:
    """A list of plain values (e.g. strings collated by default_collate): one value per sample."""
    return isinstance(data, (list, tuple)) and not any(
        isinstance(x, (list, tuple, Mapping, torch.Tensor)) for x in data)


def count_rows(data: Any) -> Optional[int]:
    """Samples in a batch: dim 0 of its first tensor (or length of its first list of values)."""
    if isinstance(data, torch.Tensor):
        return data.shape[0] if data.ndim else None
    if _is_row_list(data):
        return len(data)
    values = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else ()
    for value in values:
        rows = count_rows(value)
        if rows is not None:
            return rows
    return None


def _map_rows(data: Any, tensor_fn: Callable, list_fn: Callable) -> Any:
    if isinstance(data, torch.Tensor):
        return tensor_fn(data) if data.ndim else data
    if _is_row_list(data):
        return list_fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: _map_rows(v, tensor_fn, list_fn) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return honor_type(data, [_map_rows(v, tensor_fn, list_fn) for v in data])
    return data


def slice_rows(data: Any, start: int, stop: int) -> Any:
    return _map_rows(data, lambda t: t[start:stop], lambda seq: type(seq)(seq[start:stop]))


def cycle_rows(data: Any, start: int, count: int) -> Any:
    """``count`` rows of ``data`` repeated end to end, from row ``start``."""
    rows = count_rows(data)
    if not rows:
        raise ValueError("cannot pad with rows of a batch that has none")
    index = [(start + i) % rows for i in range(count)]
    return _map_rows(data, lambda t: t[torch.tensor(index, device=t.device)],
                     lambda seq: type(seq)(seq[i] for i in index))


def cat_rows(batches: list) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches) if first.ndim else first
    if _is_row_list(first):
        return type(first)(x for b in batches for x in b)
    if isinstance(first, Mapping):
        return type(first)({k: cat_rows([b[k] for b in batches]) for k in first})
    if isinstance(first, (list, tuple)):
        return honor_type(first, [cat_rows([b[i] for b in batches]) for i in range(len(first))])
    return first


# -- broadcasting a nested structure ----------------------------------------------------------------
class _Spec:
    """Stands for a tensor in the outline sent ahead of the data."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def _outline(data: Any, tensors: list) -> Any:
    if isinstance(data, torch.Tensor):
        tensors.append(data)
        return _Spec(data)
    if isinstance(data, Mapping):
        return type(data)({k: _outline(v, tensors) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return honor_type(data, [_outline(v, tensors) for v in data])
    return data


def _fill(outline: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if isinstance(outline, _Spec):
        return next(tensors)
    if isinstance(outline, Mapping):
        return type(outline)({k: _fill(v, tensors) for k, v in outline.items()})
    if isinstance(outline, (list, tuple)):
        return honor_type(outline, [_fill(v, tensors) for v in outline])
    return outline


def _specs(outline: Any, out: list) -> list:
    if isinstance(outline, _Spec):
        out.append(outline)
    elif isinstance(outline, Mapping):
        for v in outline.values():
            _specs(v, out)
    elif isinstance(outline, (list, tuple)):
        for v in outline:
            _specs(v, out)
    return out


def _default_sampling(dataset: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the sampler a ``DataLoader`` would build from ``batch_size``/``shuffle``/``drop_last``."""
    from torch.utils.data import RandomSampler, SequentialSampler

    kwargs = dict(kwargs)
    shuffle = kwargs.pop("shuffle", False)
    sampler = RandomSampler(dataset, generator=kwargs.get("generator")) if shuffle else SequentialSampler(dataset)
    batch_size = kwargs.pop("batch_size", 1)
    if batch_size is None:  # no batching: one sample at a time
        kwargs["sampler"] = sampler
    else:
        kwargs["batch_sampler"] = BatchSampler(sampler, batch_size, kwargs.pop("drop_last", False))
    return kwargs


class _HeadSkipBatchSampler(BatchSampler):
    """Yields the first ``head`` batches, then those from ``skip`` on: O(1) skipping, exact padding."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.head = 0
        self.skip = 0

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self.batch_sampler.sampler = value

    def set_epoch(self, epoch: int) -> None:
        for obj in (self.batch_sampler, self.sampler):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        head, skip = self.head, self.skip
        for index, batch in enumerate(self.batch_sampler):
            if index < head or index >= skip:
                yield batch


class DataLoaderDispatcher(PreparedLoaderMixin, DataLoader):
    """A DataLoader iterated by process 0 only, which sends every process its part of each step.

    Args:
        dataset: the user's dataset (read on process 0 only).
        split_batches: cut each batch of the loader into ``num_processes`` parts (else each process
            gets whole batches: N consecutive batches make a step).
        even_batches: complete the last step with rows from the first one so that every process
            gets a full batch; without it the last step is handed out as it is.
        slice_fn: ``slice_fn(batch, slice, process_index=, num_processes=)`` cuts a batch in
            split mode (default: rows of every tensor and list of values).
        device: where each process's batches go.
        **kwargs: ``torch.utils.data.DataLoader`` arguments of the real loader.
    """

    def __init__(self, dataset: Any, split_batches: bool = False, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 slice_fn: Optional[Callable] = None, even_batches: bool = True,
                 device: Optional[torch.device] = None, rng_types: Optional[list] = None,
                 synchronized_generator: Optional[torch.Generator] = None, iteration: int = 0,
                 data_parallel: Optional[DataParallel] = None, **kwargs: Any) -> None:
        self._init_kwargs = dict(kwargs)
        iterable = isinstance(dataset, IterableDataset)
        inner = None
        if not iterable:
            if kwargs.get("batch_sampler") is None and kwargs.get("sampler") is None:
                kwargs = _default_sampling(dataset, kwargs)  # built by hand, as a DataLoader: batch_size=, shuffle=
            key = "batch_sampler" if kwargs.get("batch_sampler") is not None else "sampler"
            inner = kwargs[key]
            if not isinstance(inner, _HeadSkipBatchSampler):
                kwargs[key] = _HeadSkipBatchSampler(inner)
        super().__init__(dataset, **kwargs)
        # Every process gets all pieces; tensor-parallel peers take the same one.
        dp = data_parallel if data_parallel is not None else current_data_parallel()
        self._data_parallel = dp
        self.num_processes, self.process_index = dp.size, dp.rank
        self.split_batches, self.even_batches = split_batches, even_batches
        self.skip_batches = skip_batches
        self.slice_fn = slice_fn
        self.device = device
        self.use_stateful_dataloader = use_stateful_dataloader
        self._drop_last, self._non_blocking = _drop_last, _non_blocking
        self._iterable = iterable
        self._init_bookkeeping(rng_types, synchronized_generator, iteration)
        self._base_batch_size = kwargs.get("batch_size") if iterable else getattr(self._wrapper, "batch_size", None)
        if split_batches and self._base_batch_size is not None and self._base_batch_size % self.num_processes:
            raise ValueError(
                f"split_batches=True cuts each batch of {self._base_batch_size} samples into {self.num_processes} "
                "equal parts; use a batch size that is a multiple of the number of processes"
            )

    @property
    def _wrapper(self) -> Optional[_HeadSkipBatchSampler]:
        for holder in (self.batch_sampler, self.__dict__.get("sampler")):
            if isinstance(holder, _HeadSkipBatchSampler):
                return holder
        return None

    @property
    def total_batch_size(self) -> int:
        size = self._base_batch_size
        return size if self.split_batches else size * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def __len__(self) -> int:
        total = len(self._wrapper) if self._wrapper is not None else super().__len__()
        n, size = self.num_processes, self._base_batch_size

        def last_length() -> Optional[int]:
            try:
                return len(self.dataset) - (total - 1) * size
            except TypeError:
                return None

        steps = count_steps(total, n, self.process_index, self.split_batches, self.even_batches, self._drop_last,
                            size, last_length)
        return max(0, steps - self.skip_batches)

    def _with_skip(self, num_batches: int) -> "DataLoaderDispatcher":
        kwargs = dict(self._init_kwargs)
        return DataLoaderDispatcher(
            self.dataset, split_batches=self.split_batches, skip_batches=self.skip_batches + num_batches,
            use_stateful_dataloader=self.use_stateful_dataloader, _drop_last=self._drop_last,
            _non_blocking=self._non_blocking, slice_fn=self.slice_fn, even_batches=self.even_batches,
            device=self.device, rng_types=self.rng_types, synchronized_generator=self.synchronized_generator,
            iteration=self.iteration, data_parallel=self._data_parallel, **kwargs)

    # -- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        with self._pass() as (_, resume):
            skip_steps = max(resume, self.skip_batches)
            self._position = skip_steps
            yield from self._run(skip_steps)

    def _padding_possible(self) -> bool:
        return self.num_processes > 1 and self.even_batches and not self._drop_last

    def _run(self, skip_steps: int) -> Iterator[Any]:
        n, rank = self.num_processes, self.process_index
        per_step = 1 if self.split_batches else n
        # The first batches are kept to pad the end (even batches, or a lone last step).
        head = (1 if self.split_batches else n) if n > 1 and not self._drop_last else 0
        skip = skip_steps * per_step
        source, tracker = None, None
        if rank == 0:
            wrapper = self._wrapper
            saved_head = None
            if wrapper is not None:  # map-style: skip indices; the head is kept for padding
                wrapper.head, wrapper.skip = head, skip
                head_only = min(head, skip)
            elif self._resume_stream(skip_steps):  # iterable that continues from its saved position
                saved_head = list((self._resume_now or {}).get("stream_head") or [])
                head, head_only = 0, 0
            else:  # iterable: the skipped batches have to be read
                head_only = skip
            # the base-seed draw of a new torch iterator is replayed on resume, not drawn again
            batches, seed_state = position.start_iterator(self, lambda: DataLoader.__iter__(self), self._resume_now)
            if seed_state is not None:
                self._seed_state = seed_state
            batches = position.replayed(batches, self._replay_now * per_step, self._epoch)  # already trained
            stream = position.stateful_stream(self)
            if stream is not None:
                state, _, pending = self._stream_after or (None, None, None)
                tracker = position.StreamTracker(stream, batches, skip if state is not None else 0, state, pending)
                batches = iter(tracker)
            source = self._groups(batches, head, head_only, skip_steps, saved_head)
        plan = EpochPlan(n)
        self._plan, self._plan_rank = plan, rank
        move = self._mover()
        current = self._exchange(source, plan)
        step = 0
        while current is not None:
            upcoming = None if plan.finished else self._exchange(source, plan)
            mine = current[rank]
            if mine is None:  # only happens at the last step, with uneven batches
                return
            last = upcoming is None or upcoming[rank] is None
            if move is not None:
                mine = move(mine)
            self._at_boundary()
            self._at_step(step, last)
            if tracker is not None:
                head_kept = self._head if self._padding_possible() else None
                self._stream_after = tracker.point((skip_steps + step + 1) * per_step, head_kept)
            yield mine
            current, step = upcoming, step + 1

    def _exchange(self, source: Optional[Iterator], plan: EpochPlan) -> Optional[list]:
        """One step: process 0 sends the outline, then the tensors; returns the per-process pieces."""
        state = PartialState()
        tensors: list = []
        header: Any = None
        if source is not None:
            item = next(source, None)
            if item is not None:
                pieces, real, final = item
                sizes = [0 if p is None else count_rows(p) for p in pieces]
                header = (_outline(pieces, tensors), sizes, real, final)
        box = [header]
        broadcast_object_list(box, from_process=0)
        header = box[0]
        if header is None:
            plan.finish()
            return None
        outline, sizes, real, final = header
        if state.use_distributed:
            comm = torch.device("cpu") if state.backend == "gloo" else state.device
            if source is not None:
                tensors = [t.to(comm) for t in tensors]
            else:
                tensors = [torch.empty(s.shape, dtype=s.dtype, device=comm) for s in _specs(outline, [])]
            if tensors:
                broadcast(tensors, from_process=0)
        pieces = _fill(outline, iter(tensors))
        plan.add(sizes, real, final)
        return pieces

    # -- process 0: resuming an iterable dataset through its own state ------------------------------
    def _resume_stream(self, skip_steps: int) -> bool:
        resume = self._resume_now or {}
        stream = position.stateful_stream(self)
        if stream is None or resume.get("dataset_state") is None or not skip_steps:
            return False
        stream.load_state_dict(resume["dataset_state"])
        self._stream_after = (resume["dataset_state"], resume.get("stream_head"),
                              list(resume.get("stream_pending") or ()))
        return True

    # -- process 0: group the real loader's batches into steps ---------------------------------------
    def _groups(self, iterator: Iterator[Any], head_count: int, head_only: int, emitted: int = 0,
                saved_head: Optional[list] = None) -> Iterator[tuple]:
        """Yields (per-process pieces, per-process real counts, is-final) for every step.

        ``emitted``: steps of the epoch already handed out (a resumed pass); ``saved_head``: the
        padding batches kept by the checkpoint of a pass resumed through the dataset's state.
        """
        head: list = list(saved_head) if saved_head is not None else []
        self._head = head
        stream = self._after_head(iterator, head, head_count, head_only)
        if self.split_batches:
            yield from self._split_groups(stream, head, emitted)
        else:
            yield from self._whole_groups(stream, head, emitted)

    @staticmethod
    def _after_head(iterator: Iterator[Any], head: list, head_count: int, head_only: int) -> Iterator[Any]:
        for index, batch in enumerate(iterator):
            if index < head_count:
                head.append(batch)
            if index >= head_only:
                yield batch

    def _whole_groups(self, stream: Iterator[Any], head: list, emitted: int = 0) -> Iterator[tuple]:
        return whole_steps(stream, self.num_processes, self._base_batch_size, count_rows, emitted, self._drop_last,
                           self.even_batches, lambda group, short_too: self._complete(group, head, short_too))

    def _complete(self, group: list, head: list, short_too: bool = True) -> list:
        n, size = self.num_processes, self._base_batch_size
        if size is None:
            return group + [head[i % len(head)] for i in range(n - len(group))]
        flat = cat_rows(head)
        out, used = list(group), 0
        short = count_rows(out[-1]) or 0
        if short_too and short < size:
            out[-1] = cat_rows([out[-1], cycle_rows(flat, 0, size - short)])
            used = size - short
        while len(out) < n:
            out.append(cycle_rows(flat, used, size))
            used += size
        return out

    def _split_groups(self, stream: Iterator[Any], head: list, emitted: int = 0) -> Iterator[tuple]:
        return split_steps(stream, self._base_batch_size, count_rows, emitted,
                           self._drop_last and self.num_processes > 1,
                           lambda batch, last, lone: self._cut(batch, head, last, lone))

    def _cut(self, batch: Any, head: list, last: bool, lone: bool = False) -> tuple:
        n = self.num_processes
        count = count_rows(batch) or 0
        size = self._base_batch_size or count
        part = size // n
        if count < size and n > 1 and (self.even_batches or not last) and head:
            batch = cat_rows([batch, cycle_rows(head[0], 0, size - count)])
        pieces = []
        for q in range(n):
            if self.slice_fn is not None:
                piece = self.slice_fn(batch, slice(q * part, (q + 1) * part), process_index=q, num_processes=n)
            else:
                piece = slice_rows(batch, q * part, (q + 1) * part)
            if count_rows(piece) == 0:
                piece = cycle_rows(head[0], 0, part) if lone and head else None
            pieces.append(piece)
        real = [max(0, min(part, count - q * part)) for q in range(n)]
        return pieces, real, last
