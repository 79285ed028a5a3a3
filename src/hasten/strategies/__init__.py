"""Parallel strategies behind one interface (``Strategy``), chosen from the process state."""

from __future__ import annotations

from typing import Any

from ..utils.dataclasses import DistributedType
from .base import Strategy, foreign_wrapper


def select_strategy(state: Any, **options: Any) -> Strategy:
    """The strategy for ``state.distributed_type``; ``options`` are the strategy's settings."""
    kind = state.distributed_type
    if kind == DistributedType.NO:
        from .single import SingleDeviceStrategy

        return SingleDeviceStrategy(state, **options)
    if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise NotImplementedError(
            f"distributed_type={kind} is not available in this version of hasten (sharded training lands "
            "with FSDP2/DeepSpeed support); remove fsdp_plugin/deepspeed_plugin (or HASTEN_USE_FSDP/"
            "HASTEN_USE_DEEPSPEED) to train with DDP"
        )
    from .ddp import DDPStrategy

    return DDPStrategy(state, **options)


__all__ = ["Strategy", "foreign_wrapper", "select_strategy"]
