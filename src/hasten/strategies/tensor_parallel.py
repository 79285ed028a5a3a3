"""Tensor parallelism alone: ``ParallelismConfig(tp_size=N)`` with every data-parallel size 1.

How layers are split (the plan) lives in ``tp_plan``; with FSDP2 (``dp_shard`` x ``tp``) the
``FSDP2Strategy`` applies the same plan before sharding.
"""

from __future__ import annotations

from typing import Any

from ..precision import Precision
from .fsdp2 import FSDP2Strategy
from .scaler import agreeing_scaler


class TensorParallelStrategy(FSDP2Strategy):
    """Tensor parallelism alone: ``ParallelismConfig(tp_size=N)`` over N processes, no FSDP.

    Every tensor-parallel rank sees the same batches; the split layers hold DTensor shards,
    the others full copies updated identically. Mixed precision is autocast (as with DDP);
    checkpoints are DCP shards.
    """

    def __init__(self, state: Any, parallelism_config: Any = None, **options: Any) -> None:
        options.pop("fsdp_plugin", None)
        super().__init__(state, fsdp_plugin=None, parallelism_config=parallelism_config, **options)
        self.distributed_type = state.distributed_type

    def build_precision(self, mode: str, scaler_kwargs: Any, autocast_kwargs: Any) -> Precision:
        precision = Precision(mode, self.state.device, scaler_kwargs, autocast_kwargs)
        precision.scaler = agreeing_scaler(precision.scaler, self.state.device)  # shards: agree on infs
        return precision

    def shards_data_parallel(self) -> bool:
        return False
