"""Placeholders for an optimizer and a scheduler that a DeepSpeed config defines (Accelerate's names).

A script that lets DeepSpeed build the optimizer from the ``optimizer`` section of its config
passes ``DummyOptim(model.parameters(), lr=...)`` to ``prepare`` (and ``DummyScheduler`` for the
``scheduler`` section); scripts often import them even when they run without DeepSpeed and pick a
real optimizer in that case. They hold their arguments and nothing else: there is no optimizer to
step without DeepSpeed, so ``Accelerator.prepare`` refuses them there (``Strategy.check_prepare_arguments``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class DummyOptim:
    """Stands for the optimizer of the DeepSpeed config; keeps ``params``, ``lr``, ``weight_decay``."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the scheduler of the DeepSpeed config (or one built by ``lr_scheduler_callable``)."""

    def __init__(self, optimizer: Any, total_num_steps: Optional[int] = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Optional[Callable[[Any], Any]] = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def check_not_dummy(objects: tuple, distributed_type: Any) -> None:
    """Refuse ``DummyOptim``/``DummyScheduler``: only DeepSpeed's engine replaces them (its strategy
    does not call this)."""
    for position, obj in enumerate(objects):
        if isinstance(obj, DummyOptim):
            section, real = "optimizer", "torch.optim.AdamW(model.parameters(), lr=...)"
        elif isinstance(obj, DummyScheduler):
            section, real = "scheduler", "a torch.optim.lr_scheduler scheduler"
        else:
            continue
        raise ValueError(
            f"prepare() got {type(obj).__name__} (argument {position}), which stands for the {section} defined in a "
            f"DeepSpeed config, but this run does not use DeepSpeed ({distributed_type}); launch with DeepSpeed and a "
            f"config that has a '{section}' section, or create a real one instead (e.g. {real})"
        )


# Accelerate has these names in this module; hasten keeps them elsewhere (see accelerate_paths).
from .accelerate_paths import names_from_utils  # noqa: E402 - after the module's own names

__getattr__ = names_from_utils(__name__, (
    "map_pytorch_optim_to_deepspeed", "get_active_deepspeed_plugin", "HfDeepSpeedConfig",
    "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper",
))
