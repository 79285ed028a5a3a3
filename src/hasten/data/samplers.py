"""Samplers that shard data across processes and record which samples are padding.

Every sharding object here yields, per process, the batches of one *step* (the N batches that the N
processes consume at the same time). While it does so it records an :class:`EpochPlan`: for each
step, how many samples every process got and how many of them are real (not duplicates added to
keep processes in step). Each process computes the plan for all processes itself (they all walk
the same index stream), so ``gather_for_metrics`` can drop padding without asking anyone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.utils.data import BatchSampler, IterableDataset

from .order import seek_batches


# -- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepRecord:
    """What every process holds at one step.

    sizes[q]: samples in process q's batch (0: q has no batch at this step; None: unknown, e.g. an
    iterable dataset that yields whole batches). real[q]: how many of them, from the start of the
    batch, are real (None: all of them); padding always sits at the end of a batch.
    """

    sizes: tuple
    real: tuple

    @property
    def regular(self) -> bool:
        """Every process has a batch of the same known size and none holds padding."""
        first = self.sizes[0]
        return all(s == first and s != 0 for s in self.sizes) and all(
            r is None or r == s for r, s in zip(self.real, self.sizes)
        )


@dataclass
class EpochPlan:
    """The steps of one pass over the data, recorded as the sharding object produces them."""

    num_processes: int
    records: dict = field(default_factory=dict)
    num_steps: int = 0
    finished: bool = False
    last_present: list = field(default_factory=list)  # per process: last step with a batch (-1: none)

    def __post_init__(self) -> None:
        self.last_present = [-1] * self.num_processes

    def add(self, sizes: Sequence, real: Sequence, final: bool = False) -> None:
        """Record the next step; ``final``: it is known to be the last one."""
        step = self.num_steps
        self.records[step] = StepRecord(tuple(sizes), tuple(real))
        for q, size in enumerate(sizes):
            if size != 0:
                self.last_present[q] = step
        self.num_steps += 1
        if final:
            self.finished = True

    def finish(self) -> None:
        self.finished = True

    def get(self, step: int) -> Optional[StepRecord]:
        return self.records.get(step)

    def forget_before(self, step: int) -> None:
        """Drop records that no process can ask about any more (keeps memory flat)."""
        for old in [s for s in self.records if s < step]:
            del self.records[old]

    @property
    def uneven(self) -> bool:
        """Processes got different numbers of batches (known once finished)."""
        return self.finished and len(set(self.last_present)) > 1

    @property
    def first_last_step(self) -> int:
        """The earliest step at which some process runs out of batches."""
        return min(self.last_present)


# -- batch-sampler sharding -------------------------------------------------------------------------
def count_steps(total: int, num_processes: int, rank: int, split_batches: bool, even_batches: bool,
                drop_last: bool, batch_size: Optional[int], last_batch_length: Any = None,
                pad_lone_step: bool = True) -> int:
    """How many batches process ``rank`` gets out of ``total`` batches (see BatchSamplerShard).

    ``last_batch_length`` (a callable, only called when needed) gives the length of the last
    batch, which decides, with split_batches and uneven batches, whether a process gets a piece.
    ``pad_lone_step``: with uneven batches, an epoch of a single step leaves no process empty.
    """
    n = num_processes
    if n == 1:
        return total
    if split_batches:
        if even_batches or drop_last or (total <= 1 and pad_lone_step):
            return total
        last = last_batch_length() if callable(last_batch_length) else last_batch_length
        return total - 1 if last is not None and 0 < last <= rank * (batch_size // n) else total
    full, extra = divmod(total, n)
    if extra == 0 or drop_last:
        return full
    if even_batches or (full == 0 and pad_lone_step):
        return full + 1
    return full + 1 if rank < extra else full


def whole_steps(batches: Iterable[Any], n: int, size: Optional[int], rows: Callable[[Any], Optional[int]],
                emitted: int, drop_last: bool, even_batches: bool,
                complete: Callable[[list, bool], list], pad_lone_step: bool = True) -> Iterator[tuple[list, list, bool]]:
    """Group whole batches into steps of ``n`` (one per process): (batches, real rows, is-final).

    A group whose last batch is short is held until more data shows it is not the end. The final
    incomplete group is kept (one process, or full with nothing to pad), dropped (``drop_last``),
    left short with ``None`` for the processes without a batch (``even_batches=False``, unless it
    is the epoch's only step and ``pad_lone_step``: then some would get nothing at all), or else completed by
    ``complete(group, pad_short_batch)``. ``emitted`` counts the steps of the epoch before
    ``batches`` (a resumed pass), so a resumed pass ends exactly as the uninterrupted one.
    """
    group: list = []
    for batch in batches:
        if len(group) == n:  # held back for its short last batch; more data came, so it is not the end
            yield group, [rows(b) for b in group], False
            group, emitted = [], emitted + 1
        group.append(batch)
        if len(group) == n and (size is None or rows(batch) == size):
            yield group, [rows(b) for b in group], False
            group, emitted = [], emitted + 1
    if not group:
        return
    real = [rows(b) for b in group] + [0] * (n - len(group))
    if n == 1 or (len(group) == n and not (even_batches and not drop_last)):
        yield group, real[:n], True
    elif drop_last:
        return
    elif not even_batches and (emitted or not pad_lone_step):
        yield group + [None] * (n - len(group)), real, True
    else:
        yield complete(group, even_batches), real, True


def split_steps(batches: Iterable[Any], size: Optional[int], rows: Callable[[Any], Optional[int]], emitted: int,
                drop_last: bool, cut: Callable[[Any, bool, bool], tuple]) -> Iterator[tuple]:
    """One step per batch, each cut into one piece per process by ``cut(batch, last, lone)``.

    A short batch is held until more data shows it is not the end. The final short batch is
    dropped (``drop_last``) or cut as the last step; ``lone`` when it is the epoch's only step (then
    pieces nobody would get are padded). ``emitted`` counts the steps of the epoch before
    ``batches`` (a resumed pass), so a resumed pass ends exactly as the uninterrupted one.
    """
    held = None
    for batch in batches:
        if held is not None:
            yield cut(held, False, False)
            held, emitted = None, emitted + 1
        if size is None or rows(batch) == size:
            yield cut(batch, False, False)
            emitted += 1
        else:
            held = batch
    if held is not None and not drop_last:
        yield cut(held, True, not emitted)


def _cycle_take(source: list, start: int, count: int) -> list:
    """``count`` items of ``source`` repeated end to end, starting at position ``start``."""
    if count <= 0:
        return []
    if not source:
        raise ValueError("cannot pad a batch from an empty first batch")
    return [source[(start + i) % len(source)] for i in range(count)]


class BatchSamplerShard(BatchSampler):
    """One process's share of the batches of ``batch_sampler``.

    Without ``split_batches``, batch ``i`` goes to process ``i % num_processes``; with it, every
    batch is cut into ``num_processes`` equal slices (the batch size must divide). With
    ``even_batches`` every process gets the same number of equally sized batches: the end is
    completed with indices from the start of the epoch (the padding). Without it the last batches
    are handed out as they are, so some processes may get one batch fewer or a shorter one, or none
    at all when the data is smaller than one step (as in Accelerate). ``pad_lone_step=True`` (what
    prepared loaders use) makes one exception: a process that would get no batch at all gets one
    batch of padding, so that it can take part in the collectives of the loop
    (``gather_for_metrics`` drops it). When the batch sampler drops its last incomplete batch, a
    final incomplete group of batches is dropped too. With one process the batches pass through
    unchanged.

    Batches are produced lazily, as the wrapped sampler yields them; the sampler's ``sampler``
    (e.g. a custom or seedable sampler) is left in place.
    """

    def __init__(self, batch_sampler: Iterable, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True, *, pad_lone_step: bool = False) -> None:
        if num_processes < 1 or not 0 <= process_index < num_processes:
            raise ValueError(
                f"process_index={process_index} is not in [0, num_processes={num_processes}); "
                "pass the rank of this process and the number of processes"
            )
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.pad_lone_step = pad_lone_step
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.skip_batches = 0
        self.current_plan: Optional[EpochPlan] = None
        self._skip_next = 0  # skip for the next pass (checkpoint resume); the loader resets it
        if split_batches:
            if self.batch_size is None:
                raise ValueError(
                    f"split_batches=True needs a batch size to split, but {type(batch_sampler).__name__} has no "
                    "`batch_size` attribute; give the batch sampler one or use split_batches=False"
                )
            if self.batch_size % num_processes != 0:
                raise ValueError(
                    f"split_batches=True cuts each batch into {num_processes} equal parts, but batch_size="
                    f"{self.batch_size} is not a round multiple of {num_processes}; use a batch size that is "
                    f"(e.g. {max(1, self.batch_size // num_processes) * num_processes}) or split_batches=False"
                )

    # The sampler inside is what users (and set_epoch) look for.
    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self.batch_sampler.sampler = value

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        for obj in (self.batch_sampler, self.sampler):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def __len__(self) -> int:
        return max(0, self._steps_for(self.process_index) - self.skip_batches)

    def _steps_for(self, rank: int) -> int:
        return count_steps(len(self.batch_sampler), self.num_processes, rank, self.split_batches, self.even_batches,
                           self.drop_last, self.batch_size, self._last_batch_length, self.pad_lone_step)

    def _last_batch_length(self) -> Optional[int]:
        try:
            count = len(self.batch_sampler.sampler)
        except (AttributeError, TypeError):
            return None
        return count - (len(self.batch_sampler) - 1) * self.batch_size

    def __iter__(self) -> Iterator[list]:
        plan = EpochPlan(self.num_processes)
        self.current_plan = plan
        # _skip_next stays until the loader clears it: a worker iterator calls iter() twice.
        skip = self.skip_batches + self._skip_next
        return self._iterate(plan, skip)

    def _iterate(self, plan: EpochPlan, skip: int) -> Iterator[list]:
        n = self.num_processes
        if n == 1 and not skip:  # one process: nothing to share out or pad (and no plan is consulted)
            yield from self.batch_sampler
            plan.finish()
            return
        # When the order can be computed at once (one permutation), batches are cut from it: resuming
        # starts at the skipped position directly, and no Python generator runs per index.
        fast = seek_batches(self.batch_sampler, skip * (1 if self.split_batches else n),
                            1 if self.split_batches else n)
        start = skip if fast is not None else 0
        source, head = fast[1] if fast else None, fast[0] if fast else None
        steps = (self._split_steps(skip, source, head) if self.split_batches
                 else self._group_steps(skip, source, head))
        for step, (batches, real, final) in enumerate(steps, start):
            if step < skip:
                continue
            # Marking the last step as such when it is recorded (before it is yielded) lets every
            # process know, while processing its last batch, whether batches ran out unevenly.
            plan.add([len(b) if b is not None else 0 for b in batches], real, final)
            mine = batches[self.process_index]
            if mine is not None:
                yield mine
        plan.finish()

    # Each generator below yields (per-process batches, per-process real counts, is-final) per step.
    def _group_steps(self, skip: int, source: Optional[Iterator] = None,
                     head: Optional[list] = None) -> Iterator[tuple[list, list, bool]]:
        """``source``/``head``: batches from step ``skip`` on and the first batches (a seek)."""
        n = self.num_processes
        keep_head = n > 1 and not self.drop_last
        head = list(head or [])  # the first n batches: the padding source

        def batches() -> Iterator[list]:
            for batch in self.batch_sampler if source is None else source:
                batch = list(batch)
                if keep_head and len(head) < n:
                    head.append(batch)
                yield batch

        return whole_steps(batches(), n, self.batch_size, len, skip if source is not None else 0, self.drop_last,
                           self.even_batches, lambda group, short_too: self._complete_group(group, head, short_too),
                           self.pad_lone_step)

    def _complete_group(self, group: list, head: list, short_too: bool = True) -> list:
        n, size = self.num_processes, self.batch_size
        if size is None:  # batches of any length: pad with whole batches from the start
            return group + [list(head[i % len(head)]) for i in range(n - len(group))]
        flat = [i for b in head for i in b]
        used = 0
        out = list(group)
        if short_too and len(out[-1]) < size:
            need = size - len(out[-1])
            out[-1] = out[-1] + _cycle_take(flat, 0, need)
            used = need
        while len(out) < n:
            out.append(_cycle_take(flat, used, size))
            used += size
        return out

    def _split_steps(self, skip: int, source: Optional[Iterator] = None,
                     first: Optional[list] = None) -> Iterator[tuple[list, list, bool]]:
        head: Optional[list] = first[0] if first else None  # the first batch: the padding source

        def batches() -> Iterator[list]:
            nonlocal head
            for batch in self.batch_sampler if source is None else source:
                batch = list(batch)
                if head is None:
                    head = batch
                yield batch

        return split_steps(batches(), self.batch_size, len, skip if source is not None else 0,
                           self.drop_last and self.num_processes > 1,
                           lambda batch, last, lone: (*self._cut(batch, head, last, lone), last))

    def _cut(self, batch: list, head: list, last: bool, lone: bool = False) -> tuple[list, list]:
        n, size = self.num_processes, self.batch_size
        part = size // n
        count = len(batch)
        if count < size and n > 1 and (self.even_batches or not last):
            batch = batch + _cycle_take(head, 0, size - count)
        pieces = [batch[q * part:(q + 1) * part] for q in range(n)]
        if lone and n > 1 and self.pad_lone_step:  # nobody may be left without a batch: pad the empty pieces
            pieces = [p if p else _cycle_take(head, 0, part) for p in pieces]
        real = [max(0, min(part, count - q * part)) for q in range(n)]
        return [p if p else None for p in pieces], real


class SkipBatchSampler(BatchSampler):
    """The batches of ``batch_sampler`` after the first ``skip_batches`` (indices only: no data read)."""

    def __init__(self, batch_sampler: Iterable, skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)


# -- iterable datasets ------------------------------------------------------------------------------
class IterableDatasetShard(IterableDataset):
    """One process's share of an iterable dataset.

    Every process reads the whole stream, cuts it into groups of ``batch_size * num_processes``
    samples (``batch_size`` with ``split_batches``) and keeps its slice of each group, so no sample
    is seen twice. Unless ``drop_last``, the final incomplete group is completed with the first
    samples of the stream so every process gets full batches. ``batch_size=None`` (a dataset that
    yields whole batches) shards those items one per process.
    """

    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, drop_last: bool = False,
                 num_processes: int = 1, process_index: int = 0, split_batches: bool = False) -> None:
        if split_batches and (batch_size is None or batch_size % num_processes != 0):
            raise ValueError(
                f"split_batches=True cuts each batch into {num_processes} equal parts, but batch_size="
                f"{batch_size} is not a round multiple of {num_processes}; use a batch size that is or split_batches=False"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0
        self._tagged = False  # set by prepare_data_loader: yield (sample, real count of its group)
        self.head: Optional[list] = None  # the pass's first group: it pads an incomplete last group
        self._resume: Optional[tuple] = None  # (dataset state, head) for a pass that continues a saved one

    @property
    def _sizes(self) -> tuple[int, int]:
        """(samples per group, samples per process in a group)."""
        unit = self.batch_size or 1
        if self.split_batches:
            return unit, unit // self.num_processes
        return unit * self.num_processes, unit

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def total_length(self) -> int:
        return len(self.dataset)

    def __len__(self) -> int:
        group, part = self._sizes
        groups = len(self.dataset) // group if self.drop_last else -(-len(self.dataset) // group)
        return groups * part

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)  # a shuffling stream: same order on every process
        group, part = self._sizes
        lo, hi = self.process_index * part, (self.process_index + 1) * part
        first: Optional[list] = None
        resume, self._resume = self._resume, None
        if resume is not None:  # after the reseed above: the restored position must win
            state, first = resume
            self.dataset.load_state_dict(state)
        self.head = first
        current: list = []
        for item in self.dataset:
            current.append(item)
            if len(current) == group:
                if first is None:
                    first = self.head = current
                yield from self._emit(current[lo:hi], group)
                current = []
        if current and not self.drop_last:
            count = len(current)
            if self.num_processes > 1:
                current = current + _cycle_take(first or list(current), 0, group - count)
            yield from self._emit(current[lo:hi], count)

    def _emit(self, items: list, group_real: int) -> Iterator[Any]:
        if self._tagged:
            for item in items:
                yield item, group_real
        else:
            yield from items


def iterable_step_record(group_real: int, batch_size: Optional[int], num_processes: int,
                         split_batches: bool) -> StepRecord:
    """The step record of a batch from a tagged :class:`IterableDatasetShard` group."""
    if batch_size is None:  # each process got one whole item; items past the real ones are padding
        return StepRecord((None,) * num_processes,
                          tuple(None if q < group_real else 0 for q in range(num_processes)))
    part = batch_size // num_processes if split_batches else batch_size
    return StepRecord((part,) * num_processes,
                      tuple(max(0, min(part, group_real - q * part)) for q in range(num_processes)))
