"""The prepared learning-rate scheduler: advances in lock-step with its optimizer.

How the schedule relates to the number of processes (Accelerate's rule, kept for compatibility):
without ``split_batches`` each optimizer step consumes one batch *per process*, so the scheduler
advances ``num_processes`` steps per optimizer step. A schedule written for the single-process
number of batches (e.g. ``num_training_steps = epochs * len(train_dataloader_before_prepare)``)
therefore ends exactly when the data runs out, on any number of processes. With ``split_batches``
the global batch is fixed, and the scheduler advances one step per optimizer step. Under pipeline
parallelism the stages of one replica read the same batches, so a step consumes one batch per
process of one stage: ``num_processes / pp_size`` (Accelerate has no pipeline to compare with). Steps on
accumulation micro-steps and steps whose optimizer update was skipped (fp16 overflow) do not count.

That last rule costs one read of the device per ``step()`` under fp16 (a host sync on CUDA): the
schedule is computed on the host from a step count that must not advance on a skipped step, and
the skip is only known on the device. The flags of all the scheduler's optimizers are combined on
the device and read once; nothing is read without fp16 or without a prepared scheduler.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from .optimizer import AcceleratedOptimizer
from .state import GradientState, PartialState


class AcceleratedScheduler:
    """Wraps an LR scheduler so that ``step()`` follows the optimizer's real updates."""

    def __init__(self, scheduler: Any, optimizers: Union[AcceleratedOptimizer, Sequence[AcceleratedOptimizer]],
                 step_with_optimizer: bool = True, split_batches: bool = False, stages: int = 1) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.stages = stages  # pipeline stages' processes reading the same batches (pp_size)
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        for opt in self.optimizers:  # a step still held (DeepSpeed's) runs before the schedule advances
            before = getattr(opt, "before_schedule", None)
            if before is not None:
                before()
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if _any_skipped(self.optimizers):
            return
        repeats = 1 if self.split_batches else PartialState().num_processes // self.stages
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
        for _ in range(repeats):
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    # Pass-throughs of the LRScheduler API.
    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "scheduler" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def _any_skipped(optimizers: Sequence[AcceleratedOptimizer]) -> bool:
    """Whether any optimizer skipped its last step; their device flags are read once, together."""
    flags = [opt.skip_flag for opt in optimizers]
    if any(flag is True for flag in flags):
        return True
    tensors = [flag for flag in flags if isinstance(flag, torch.Tensor)]
    if not tensors:
        return False
    if len(tensors) == 1:
        return bool(tensors[0])
    device = tensors[0].device
    return bool(torch.stack([t.reshape(()).to(device=device, dtype=torch.bool) for t in tensors]).any())
