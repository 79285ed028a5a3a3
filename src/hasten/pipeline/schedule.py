"""torch.distributed.pipelining's schedules, built from their names; which stages each process runs.

hasten never runs a schedule of its own: the order of forwards, backwards and sends is torch's.
Stage placement follows what each schedule expects of ``PipelineStage`` indices:

* one stage per process (GPipe, 1F1B): process ``r`` runs stage ``r``;
* looped (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble): process ``r`` runs ``r, r + pp, r + 2 pp, ...``;
* V-shaped (ZBVZeroBubble, DualPipeV): process ``r`` runs ``r`` and ``2 pp - 1 - r``, so the first
  and the last stage are both on process 0.

Every schedule is built with ``scale_grads=False``: torch would otherwise divide *every* gradient
by the number of microbatches after each step, including gradients accumulated over earlier steps
(gradient accumulation), and would assume equal microbatch losses; hasten normalises the loss of
each microbatch over the global batch itself (``model.PipelinedModel``).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..utils.parallelism_config import PP_V_SHAPED


def local_stage_indices(schedule: str, pp_rank: int, pp_size: int, per_rank: int) -> list[int]:
    """The stage indices process ``pp_rank`` of the pipeline runs (see the module docstring)."""
    if schedule in PP_V_SHAPED:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(per_rank)]


def stage_owner(schedule: str, stage: int, pp_size: int, per_rank: int) -> int:
    """The pipeline rank that runs ``stage``."""
    for rank in range(pp_size):
        if stage in local_stage_indices(schedule, rank, pp_size, per_rank):
            return rank
    raise ValueError(f"stage {stage} is not run by any of the {pp_size} pipeline processes")


def build_schedule(name: str, stages: list, microbatches: int, loss_fn: Callable) -> object:
    """torch's schedule class named ``name`` over the local ``PipelineStage`` objects."""
    from torch.distributed.pipelining import schedules

    try:
        cls = schedules.get_schedule_class(name)
    except ValueError as error:
        raise ValueError(f"ParallelismConfig: pp_schedule={name!r} is not known to torch {torch.__version__} "
                         f"({error}); use 'GPipe', '1F1B' or 'Interleaved1F1B'") from error
    if issubclass(cls, schedules.PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"pp_schedule={name!r} runs one stage per process, not {len(stages)}")
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
