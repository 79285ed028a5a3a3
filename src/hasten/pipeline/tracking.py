"""Where a pipelined step is, for hang and failure reports: stage, schedule, step and the schedule's action.

``PipelinedModel`` wraps the compute actions of torch's ``PipelineStage`` objects
(``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``: the only per-microbatch
calls every schedule makes) so that each start and end of an action sets ``hasten.progress`` (one
string, a counter: no I/O, no lock). The launcher's heartbeat shows it in a hang report; an exception
raised during the step gets a note with the same text (``BaseException.add_note``), so the traceback
of a failed rank says which stage, schedule, step and microbatch it was running.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

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

    def where(self) -> str:
        text = f"{self.base}, during step {self.step}"
        return text + (f": {self.action}" if self.action else ": before its first action")

    def instrument(self, stages: list) -> None:
        """Wrap the compute actions of torch's ``PipelineStage`` objects (instance attributes)."""
        for stage in stages:
            for name, label in _ACTIONS.items():
                fn = getattr(stage, name, None)
                if fn is not None:
                    setattr(stage, name, self._wrap(fn, label, stage.stage_index, name))

    def _wrap(self, fn: Callable, label: str, stage_index: int, name: str) -> Callable:
        @functools.wraps(fn)
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            what = label
            if name == "backward_one_chunk" and not kwargs.get("full_backward", args[1] if len(args) > 1 else True):
                what = "input-gradient backward"
            text = f"{what} of microbatch {chunk} on stage {stage_index}"
            self.action = text
            progress.pipeline_at(self.where())
            result = fn(chunk, *args, **kwargs)
            # Between actions torch sends and receives: a hang there waits for a peer stage.
            self.action = f"after the {text} (sending/receiving between stages)"
            progress.pipeline_at(self.where())
            return result

        return run

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
