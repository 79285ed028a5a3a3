"""Tensor parallelism alone: ``ParallelismConfig(tp_size=N)`` with every data-parallel size 1.

How layers are split (the plan) lives in ``tp_plan``; what this shares with FSDP2 (the mesh,
DTensor parameters, norms, DCP checkpoints) in ``dtensor``. With FSDP2 (``dp_shard`` x ``tp``)
the ``FSDP2Strategy`` applies the same plan before sharding.
"""

from __future__ import annotations

from typing import Any

from ..precision import Precision
from ..utils.fsdp_plugin import FullyShardedDataParallelPlugin
from .dtensor import DTensorStrategy
from .scaler import agreeing_scaler


class TensorParallelStrategy(DTensorStrategy):
    """Tensor parallelism alone: ``ParallelismConfig(tp_size=N)`` over N processes, no FSDP.

    Every tensor-parallel rank sees the same batches; the split layers hold DTensor shards,
    the others full copies updated identically. Mixed precision is autocast (as with DDP);
    checkpoints are DCP shards.
    """

    def __init__(self, plan: Any) -> None:
        # Loading from process 0 is asked for through the FSDP plugin's variables
        # (FSDP_CPU_RAM_EFFICIENT_LOADING, ...), read (and checked) as they always were.
        self._rank0_loading = bool(FullyShardedDataParallelPlugin().cpu_ram_efficient_loading)
        super().__init__(plan)
        self.distributed_type = plan.distributed_type

    def build_precision(self, mode: str, scaler_kwargs: Any, autocast_kwargs: Any) -> Precision:
        precision = Precision(mode, self.state.device, scaler_kwargs, autocast_kwargs)
        precision.scaler = agreeing_scaler(precision.scaler, self.state.device)  # shards: agree on infs
        return precision

    def loads_from_rank0(self) -> bool:
        return self._rank0_loading
