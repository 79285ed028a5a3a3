"""Accelerate's tensor- and context-parallel settings objects, read by hasten's ``ParallelismConfig``.

``TorchTensorParallelPlugin`` is Accelerate's older way to ask for tensor parallelism; ``Accelerator``
turns it into ``ParallelismConfig(tp_size=...)`` as Accelerate does. The two ``*Config`` objects are
the ``tp_handler``/``cp_handler`` of a ``ParallelismConfig``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

_CP_COMM_STRATEGIES = ("allgather", "alltoall")  # the same two as hasten.strategies.context_parallel


@dataclass
class TorchTensorParallelPlugin:
    """Tensor parallelism over ``tp_size`` processes (DTensor). Prefer ``ParallelismConfig(tp_size=...)``.

    Args:
        tp_size: processes one layer's weights are split over.
        torch_device_mesh: kept for Accelerate's signature; hasten builds the mesh from the process topology
            and refuses a mesh given here (pass ``ParallelismConfig`` instead).
    """

    tp_size: int = 1
    torch_device_mesh: Optional[Any] = None

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"TorchTensorParallelPlugin: tp_size={self.tp_size!r}; use a whole number >= 1")
        if self.torch_device_mesh is not None:
            raise ValueError("TorchTensorParallelPlugin: torch_device_mesh is not taken by hasten (it builds the mesh "
                             "from the launched processes); pass parallelism_config=ParallelismConfig(tp_size=...)")


@dataclass
class TorchTensorParallelConfig:
    """The ``tp_handler`` of ``ParallelismConfig``. ``enable_async_tp`` is not offered (as in Accelerate,
    which warns and ignores it); hasten refuses it rather than ignore it."""

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            raise ValueError("TorchTensorParallelConfig: enable_async_tp=True is not supported (Accelerate ignores it "
                             "too); leave it False")


@dataclass
class TorchContextParallelConfig:
    """The ``cp_handler`` of ``ParallelismConfig``: how keys and values travel between the context-parallel
    processes, ``"allgather"`` (default) or ``"alltoall"`` (``PARALLELISM_CONFIG_CP_COMM_STRATEGY`` when unset)."""

    cp_comm_strategy: Optional[str] = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in _CP_COMM_STRATEGIES:
            # Accelerate's words first ("Invalid cp_comm_strategy: X"), which scripts and tests match.
            raise ValueError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy} (TorchContextParallelConfig); use one "
                             f"of {list(_CP_COMM_STRATEGIES)}")
