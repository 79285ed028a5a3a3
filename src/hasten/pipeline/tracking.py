"""Where a pipelined step is, for hang and failure reports: stage, schedule, step and the schedule's action.

``PipelinedModel`` builds its stages as ``TrackedStage``, a subclass of torch's ``PipelineStage`` whose
compute actions (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``: the only
per-microbatch calls every schedule makes) tell a ``StepTracker`` when each starts and ends, which sets
``hasten.progress`` (one string, a counter: no I/O, no lock). The launcher's heartbeat shows it in a hang report; an exception
raised during the step gets a note with the same text (``BaseException.add_note``), so the traceback
of a failed rank says which stage, schedule, step and microbatch it was running.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from torch.distributed.pipelining import PipelineStage

from .. import progress

_ACTIONS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "weight-gradient backward",
}


class StepTracker:
    """The position of one pipelined model's schedule step (see the module docstring)."""

    def __init__(self, stage_indices: list[int], num_stages: int, pp_rank: int, pp_size: int, schedule: str) -> None:
        if len(stage_indices) == 1:
            stages = f"pipeline stage {stage_indices[0]} of {num_stages}"
        else:
            stages = f"pipeline stages {', '.join(map(str, stage_indices))} of {num_stages}"
        self.base = f"{stages} (process {pp_rank} of {pp_size} in the pipeline), schedule {schedule}"
        self.step = 0  # calls of the pipelined model (schedule steps, training or eval)
        self.action: Optional[str] = None  # the action under way, or the last one finished ("after ...")
        self.busy = 0.0  # seconds inside compute actions (bench/pipeline.py measures the bubble with it)

    def where(self) -> str:
        text = f"{self.base}, during step {self.step}"
        return text + (f": {self.action}" if self.action else ": before its first action")

    def around(self, label: str, stage_index: int, chunk: int, run: Callable[[], Any]) -> Any:
        """Run one compute action of ``stage_index`` on microbatch ``chunk``, marking its start and end."""
        text = f"{label} of microbatch {chunk} on stage {stage_index}"
        self.action = text
        progress.pipeline_at(self.where())
        start = time.perf_counter()
        try:
            result = run()
        finally:
            self.busy += time.perf_counter() - start
        # Between actions torch sends and receives: a hang there waits for a peer stage.
        self.action = f"after the {text} (sending/receiving between stages)"
        progress.pipeline_at(self.where())
        return result

    def begin(self) -> None:
        self.step += 1
        self.action = None
        progress.pipeline_at(self.where())

    def doing(self, action: str) -> None:
        self.action = action
        progress.pipeline_at(self.where())

    def end(self) -> None:
        progress.pipeline_at(None)

    def annotate(self, error: BaseException) -> None:
        """Add the step's position to an exception raised inside it (shown under its traceback)."""
        note = f"hasten: raised in {self.where()}"
        if hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):  # Python >= 3.11
            error.add_note(note)


class TrackedStage(PipelineStage):
    """torch's ``PipelineStage`` whose compute actions report to ``tracker`` (see the module docstring)."""

    def __init__(self, tracker: StepTracker, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = tracker

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self.tracker.around(_ACTIONS["forward_one_chunk"], self.stage_index, fwd_chunk_id,
                                   lambda: super(TrackedStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        label = _ACTIONS["backward_one_chunk"] if full else "input-gradient backward"
        return self.tracker.around(label, self.stage_index, bwd_chunk_id,
                                   lambda: super(TrackedStage, self).backward_one_chunk(bwd_chunk_id, *args, **kwargs))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self.tracker.around(_ACTIONS["backward_weight_one_chunk"], self.stage_index, bwd_chunk_id,
                                   lambda: super(TrackedStage, self).backward_weight_one_chunk(bwd_chunk_id, *args,
                                                                                               **kwargs))
