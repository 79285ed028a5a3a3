"""``gather_for_metrics``: gather across processes and keep exactly the dataset's samples.

How padding is recognised: every prepared loader records, for each step (the N batches the N
processes hold at the same time), how many samples each process got and how many of them are real
(:class:`~hasten.data.samplers.StepRecord`); every process computes this for all processes from
the sharding plan itself, so no communication is needed to know it. Padding always sits at the end
of a batch. A call made while the loader is at step ``t`` is one *round*:

* regular round (every process has a batch of the same size, no padding): one plain ``gather``
  (``gather_object`` for objects): the common case costs exactly what ``gather`` costs;
* otherwise (the last step(s) only): each process cuts the padding off its own data, then one
  small ``all_gather_object`` exchanges the shapes (or, for objects, the objects), and tensors are
  gathered padded to the largest share and cut back.

Uneven batches (``even_batches=False``): a process that has run out of batches cannot call again,
so in the call made for its last batch it also takes part, contributing nothing, in the rounds of
the steps it does not have; every process therefore receives every sample exactly once over the
loop. This needs one ``gather_for_metrics`` call per batch (gather several values in one call, as a
tuple or dict): from the first last batch on, every round checks that all processes are at the same
step and call, and raises instead of mixing data up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..state import GradientState, PartialState, data_parallel as current_data_parallel
from ..topology import DataParallel
from ..utils.operations import concatenate, gather, gather_object, honor_type, recursively_apply
from .samplers import StepRecord

_TAG = "hasten.gather_for_metrics"


@dataclass
class _Round:
    step: int
    record: StepRecord
    present: bool  # this process has a batch at this step (False: it only helps the others)
    checked: bool  # shapes are exchanged first (padding, uneven sizes, or past a process's last batch)
    call: int  # which gather_for_metrics call of the current batch this is


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(v) for v in data)
    return False


def _rounds(loader: Any, state: "_Replicas") -> Optional[list]:
    """The rounds this call takes part in, or None when the loader gives no plan to go by."""
    plan = getattr(loader, "_plan", None)
    step = getattr(loader, "_step", None)
    if plan is None or step is None or plan.num_processes != state.num_processes:
        return None
    if getattr(loader, "_plan_rank", None) != state.process_index:
        return None
    if plan.get(step) is None:
        return None
    call = loader._gfm_calls
    loader._gfm_calls += 1
    steps = [step]
    if loader.end_of_dataloader and plan.finished:  # our last batch: help with the steps we do not have
        steps += [t for t in range(step + 1, plan.num_steps) if plan.get(t) is not None]
    rounds = []
    for t in steps:
        record = plan.get(t)
        checked = not record.regular or (plan.uneven and t >= plan.first_last_step)
        rounds.append(_Round(t, record, t == step, checked, call))
    return rounds


def gather_for_metrics(input_data: Any, use_gather_object: bool = False, *,
                       data_parallel: Optional[DataParallel] = None) -> Any:
    """Gather ``input_data`` from every process, without the samples that padding duplicated.

    Inside a loop over a prepared dataloader (the active one in ``GradientState``), the result
    holds each sample of the dataset exactly once over the loop, on every process: the padding
    that ``even_batches`` (or an iterable dataset's last group) added is dropped, using the
    loader's record of which samples of each batch are real (see this module's docstring). With
    ``even_batches=False``, a process whose batches run out first takes part in the remaining
    rounds inside the call for its last batch and gets their results there; call this once per
    batch (pass a tuple/dict to gather several values together).

    Args:
        input_data: tensors nested in dicts/lists/tuples (dim 0 is the sample dimension; a tensor
            whose dim 0 differs from the batch size is kept whole, except in a batch that is only
            padding), or picklable objects (a list holds one object per sample).
        use_gather_object: gather as Python objects (automatic when ``input_data`` holds anything
            other than tensors).
        data_parallel: the processes to gather over (``ParallelMesh.data_parallel()``; the Accelerator
            passes its strategy's); default: those of the running Accelerator.

    Outside a prepared dataloader it is ``gather`` (``gather_object`` for objects).
    """
    objects = use_gather_object or not _all_tensors(input_data)
    if not PartialState().use_distributed:
        return input_data if objects else _one_process(input_data)
    state = _Replicas.of(data_parallel)
    loader = GradientState().active_dataloader if GradientState._shared_state else None
    rounds = _rounds(loader, state) if loader is not None else None
    if rounds is None:
        return state.gather_object(input_data) if objects else state.gather(input_data)
    results = [_run_round(input_data, r, objects, state) for r in rounds]
    if len(results) == 1:
        return results[0]
    if objects:
        return [item for result in results for item in result]
    return concatenate(results)


def _one_process(data: Any) -> Any:
    """One process pads nothing, so every tensor is kept, but for one case, where hasten agrees with
    Accelerate: in a prepared loader's last, short batch, a tensor with one row per entry of the *configured*
    batch (transformers' ``Trainer`` gathers ``loss.repeat(batch_size)``) is cut to the batch's samples, as
    several processes cut a padded batch; the short batch then weighs what it holds in an average."""
    gradient_state = GradientState()
    loader = gradient_state.active_dataloader if GradientState._shared_state else None
    size = getattr(loader, "total_batch_size", None)
    remainder = getattr(gradient_state, "remainder", -1)
    if loader is None or not gradient_state.end_of_dataloader or not size or not 0 < remainder < size:
        return data

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:remainder] if tensor.ndim > 0 and tensor.shape[0] == size else tensor

    return recursively_apply(cut, data)


# -- one round --------------------------------------------------------------------------------------
def _keep(rows: int, real: Optional[int], size: Optional[int]) -> int:
    """How many leading rows of a tensor/list with ``rows`` rows are real samples."""
    if real is None:
        return rows
    if real == 0:
        return 0
    return real if rows == size else rows  # not one row per sample: nothing to cut


def _local_objects(data: Any, real: Optional[int], size: Optional[int]) -> list:
    if isinstance(data, (list, tuple)):
        return list(data[:_keep(len(data), real, size)])
    return [] if real == 0 else [data]


def _trim(tensor: torch.Tensor, real: Optional[int], size: Optional[int]) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    return tensor[:_keep(tensor.shape[0], real, size)]


def _outline(data: Any, leaves: list) -> Any:
    """The structure of ``data`` with each tensor replaced by (shape, dtype); tensors go to ``leaves``."""
    if isinstance(data, torch.Tensor):
        leaves.append(data)
        return (tuple(data.shape), str(data.dtype))
    if isinstance(data, Mapping):
        return {"__map__": [(k, _outline(v, leaves)) for k, v in data.items()]}
    if isinstance(data, (list, tuple)):
        return {"__seq__": [_outline(v, leaves) for v in data]}
    return data


def _specs(outline: Any, out: list) -> list:
    if isinstance(outline, tuple):
        out.append(outline)
    elif isinstance(outline, dict) and "__map__" in outline:
        for _, v in outline["__map__"]:
            _specs(v, out)
    elif isinstance(outline, dict) and "__seq__" in outline:
        for v in outline["__seq__"]:
            _specs(v, out)
    return out


def _rebuild(template: Any, leaves: Any) -> Any:
    """``template``'s structure (the caller's own data, or None) filled with ``leaves`` in order."""
    if isinstance(template, torch.Tensor):
        return next(leaves)
    if isinstance(template, Mapping):
        return type(template)({k: _rebuild(v, leaves) for k, v in template.items()})
    if isinstance(template, (list, tuple)):
        return honor_type(template, [_rebuild(v, leaves) for v in template])
    return template


class _Replicas:
    """The data-parallel processes (one per replica): those whose samples the gather collects.

    Without tensor/context parallelism every process is a replica and the default group serves;
    otherwise the gathers run over this process's data-parallel group.
    """

    def __init__(self, rank: int, size: int, group: Any, device: torch.device) -> None:
        self.process_index, self.num_processes, self.group, self.device = rank, size, group, device

    @classmethod
    def of(cls, dp: Optional[DataParallel] = None) -> "_Replicas":
        """The replicas of the data-parallel view ``dp`` (default: the running Accelerator's)."""
        dp = dp if dp is not None else current_data_parallel()
        return cls(dp.rank, dp.size, dp.group, PartialState().device)

    def gather(self, data: Any) -> Any:
        if self.group is None:
            return gather(data)
        comm = torch.device("cpu") if dist.get_backend(self.group) == "gloo" else self.device

        def one(tensor: torch.Tensor) -> torch.Tensor:
            tensor = (tensor.reshape(1) if tensor.ndim == 0 else tensor).contiguous()
            parts = [torch.empty_like(tensor, device=comm) for _ in range(self.num_processes)]
            dist.all_gather(parts, tensor.to(comm), group=self.group)
            return torch.cat(parts).to(tensor.device)

        return recursively_apply(one, data)

    def gather_object(self, obj: Any) -> list:
        if self.group is None:
            return gather_object(obj)
        out: list = []
        for item in self.all_gather_object(obj):
            out.extend(item) if isinstance(item, (list, tuple)) else out.append(item)
        return out

    def all_gather_object(self, obj: Any) -> list:
        return _all_gather_object(obj, self)


def _all_gather_object(obj: Any, state: _Replicas) -> list:
    everyone: list = [None] * state.num_processes
    dist.all_gather_object(everyone, obj, group=state.group)
    return everyone


def _check_same_round(headers: list, me: int) -> None:
    wanted = headers[me]
    if all(h == wanted for h in headers):
        return
    where = ", ".join(
        f"process {q}: step {h[1]}, call {h[2]} ({h[3]})" if isinstance(h, tuple) and len(h) == 4 and h[0] == _TAG
        else f"process {q}: another collective" for q, h in enumerate(headers))
    raise RuntimeError(
        f"gather_for_metrics: the processes are at different gather rounds ({where}). When processes get "
        "different numbers of batches (even_batches=False), the one that runs out first joins the remaining "
        "rounds inside the call for its last batch, which only works with one gather_for_metrics call per batch "
        "and no other collective in between: gather everything at once, e.g. gather_for_metrics((preds, labels))"
    )


def _run_round(data: Any, rnd: _Round, objects: bool, state: _Replicas) -> Any:
    if not rnd.checked:
        return state.gather_object(data) if objects else state.gather(data)
    me = state.process_index
    size, real = rnd.record.sizes[me], rnd.record.real[me]
    header = (_TAG, rnd.step, rnd.call, "objects" if objects else "tensors")
    if objects:
        mine = _local_objects(data, real, size) if rnd.present else []
        everyone = state.all_gather_object((header, mine))
        _check_same_round([h for h, _ in everyone], me)
        return [item for _, items in everyone for item in items]

    leaves: list = []
    if rnd.present:
        outline = _outline(data, leaves)
        leaves = [_trim(t, real, size) for t in leaves]
        outline = _outline(_rebuild(data, iter(leaves)), [])
    else:
        outline = None
    everyone = state.all_gather_object((header, outline))
    _check_same_round([h for h, _ in everyone], me)
    specs = [None if o is None else _specs(o, []) for _, o in everyone]
    ref = next(s for s in specs if s is not None)
    own = len(_specs(_outline(data, []), []))
    if own != len(ref) or any(s is not None and len(s) != len(ref) for s in specs):
        raise RuntimeError("gather_for_metrics: the processes passed structures with different numbers of tensors; "
                           "pass the same structure on every process")
    device = next((t.device for t in leaves), state.device)
    buffers, rows_per_leaf = [], []
    for i, (shape, dtype) in enumerate(ref):
        rows = [0 if s is None else s[i][0][0] for s in specs]
        tails = {tuple(s[i][0][1:]) for s in specs if s is not None and s[i][0][0] > 0}
        if len(tails) > 1:
            raise RuntimeError(
                f"gather_for_metrics: tensor #{i} has different shapes beyond dim 0 on different processes "
                f"({sorted(tails)}); pad them to the same size first (e.g. pad_across_processes with even_batches=True)"
            )
        tail = tails.pop() if tails else tuple(shape[1:])
        target = max(rows)
        local = leaves[i] if rnd.present else None
        if local is not None and local.shape[0] == target and tuple(local.shape[1:]) == tail:
            buffer = local.contiguous()
        else:
            buffer = torch.zeros((target, *tail), dtype=getattr(torch, dtype.replace("torch.", "")), device=device)
            if local is not None and local.shape[0]:
                buffer[:local.shape[0]] = local
        buffers.append(buffer)
        rows_per_leaf.append((rows, target))
    if any(target for _, target in rows_per_leaf):  # the same on every process: all or none gather
        gathered = state.gather(buffers)
    else:
        gathered = buffers
    results = []
    for g, (rows, target) in zip(gathered, rows_per_leaf):
        results.append(torch.cat([g[q * target:q * target + r] for q, r in enumerate(rows)]) if target else g)
    # The caller's own data gives the structure (in the rounds it only helps with, that of its last batch).
    return _rebuild(data, iter(results))
