"""Parallel strategies behind one interface (``Strategy``), chosen from the process state."""

from __future__ import annotations

from typing import Any

from ..utils.dataclasses import DistributedType
from .base import Strategy, foreign_wrapper, user_sharded


def select_strategy(state: Any, **options: Any) -> Strategy:
    """The strategy for ``state.distributed_type``; ``options`` are the strategy's settings."""
    kind = state.distributed_type
    if kind == DistributedType.NO:
        from .single import SingleDeviceStrategy

        options.pop("fsdp_plugin", None)
        options.pop("parallelism_config", None)
        options.pop("deepspeed_plugin", None)
        return SingleDeviceStrategy(state, **options)
    if kind == DistributedType.FSDP:
        from .fsdp2 import FSDP2Strategy

        options.pop("deepspeed_plugin", None)
        return FSDP2Strategy(state, **options)
    options.pop("fsdp_plugin", None)
    config = options.pop("parallelism_config", None)
    if config is not None and config.tp_size > 1 and kind != DistributedType.DEEPSPEED:
        from .tensor_parallel import TensorParallelStrategy

        return TensorParallelStrategy(state, parallelism_config=config, **options)
    if kind == DistributedType.DEEPSPEED:
        from .deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(state, **options)
    options.pop("deepspeed_plugin", None)
    from .ddp import DDPStrategy

    return DDPStrategy(state, **options)


__all__ = ["Strategy", "foreign_wrapper", "select_strategy", "user_sharded"]
