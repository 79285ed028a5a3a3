"""The ``Accelerator``'s view of the parallel layout (Accelerate's names).

Without a ``parallelism_config`` every process is a data-parallel replica (or FSDP/DeepSpeed
shard), so the per-dimension ranks are errors and the device mesh is ``None``; with one, they are
read from the strategy's mesh. Kept apart so the facade stays about training.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from .utils.dataclasses import DistributedType

_DEVICE_TYPES = {
    DistributedType.MULTI_GPU, DistributedType.MULTI_MLU, DistributedType.MULTI_SDAA, DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU, DistributedType.MULTI_XPU, DistributedType.MULTI_HPU, DistributedType.MULTI_NEURON,
}


def _not_configured(kind: str) -> RuntimeError:
    return RuntimeError(f"{kind} parallelism is not configured: pass Accelerator(parallelism_config="
                        "ParallelismConfig(...)), or use accelerator.process_index for the data-parallel rank")


class ParallelLayoutMixin:
    """Read-only facts about how the model is spread over processes, read from ``self.state``."""

    state: Any
    strategy: Any
    _parallelism_config: Optional[Any]  # set by Accelerator.__init__

    @property
    def multi_device(self) -> bool:
        """Several processes, each on its own accelerator device (not CPU processes)."""
        return bool(self.state.use_distributed) and self.state.distributed_type in _DEVICE_TYPES

    @property
    def deepspeed_plugin(self) -> Any:
        """The DeepSpeed plugin in use, or ``None``."""
        return getattr(self.state, "deepspeed_plugin", None)

    @property
    def is_fsdp2(self) -> bool:
        """Whether the model is sharded with FSDP (hasten's FSDP is FSDP2, ``fully_shard``)."""
        return self.state.distributed_type == DistributedType.FSDP

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def parallelism_config(self) -> Optional[Any]:
        """The ``ParallelismConfig`` in use, or ``None`` (plain data parallelism)."""
        return self._parallelism_config

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """The loader for DeepSpeed Ulysses sequence parallelism; hasten has none (``sp_size`` must be 1,
        ``ParallelismConfig`` refuses more), so ``dl`` is returned as it is, as Accelerate does at sp_size 1.
        For long sequences, use ``cp_size`` (context parallelism)."""
        sp_size = getattr(self.parallelism_config, "sp_size", 1) or 1
        if sp_size > 1:  # not reachable through ParallelismConfig; an object made otherwise is refused
            raise ValueError(f"deepspeed_ulysses_dl_adapter: sp_size={sp_size}: DeepSpeed Ulysses sequence "
                             "parallelism is not available in hasten; use ParallelismConfig(cp_size=...) instead")
        return dl

    @property
    def torch_device_mesh(self) -> Optional[Any]:
        """The torch ``DeviceMesh`` of the ``parallelism_config`` layout, or ``None`` without one (or
        without a process group: one process has nothing to lay out)."""
        if self.parallelism_config is None or not self.state.use_distributed:
            return None
        return self.strategy.mesh.device_mesh()

    def _coordinate(self, dim: str, kind: str) -> int:
        if self.parallelism_config is None:
            raise _not_configured(kind)
        return self.strategy.mesh.coordinates()[dim]

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files (one per node)."""
        return self.state.is_local_main_process

    @property
    def data_parallel_rank(self) -> int:
        return self._coordinate("dp_replicate", "Data")

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._coordinate("dp_shard", "Sharded data")

    @property
    def tensor_parallel_rank(self) -> int:
        return self._coordinate("tp", "Tensor")

    @property
    def context_parallel_rank(self) -> int:
        return self._coordinate("cp", "Context")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise _not_configured("Pipeline")

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: Optional[list] = None, buffer_seq_dims: Optional[list[int]] = None,
                               no_restore_buffers: Optional[set] = None) -> Iterator[None]:
        """Run the block with each sequence split over the context-parallel processes (``cp_size > 1``).

        ``buffers`` (input ids, labels, position ids; not parameters) are sharded in place along their
        ``buffer_seq_dims`` and restored on exit, except those in ``no_restore_buffers``; attention
        must be causal ``scaled_dot_product_attention``. Enter it anew for every step. With
        ``cp_size == 1`` (or no ``parallelism_config``) it changes nothing (one warning says so), so
        the same loop runs with and without context parallelism.
        """
        config = self.parallelism_config
        if config is None or config.cp_size == 1:
            from .logging import get_logger

            get_logger(__name__).warning_once("maybe_context_parallel: context parallelism is off (cp_size=1); the "
                                              "block runs unchanged. Set ParallelismConfig(cp_size=N) to turn it on")
            yield
            return
        from .strategies.context_parallel import sharded_sequences

        with sharded_sequences(self.strategy.mesh["cp"], buffers, buffer_seq_dims, no_restore_buffers):
            yield

    def verify_device_map(self, model: Any) -> bool:
        """Whether ``model`` was loaded spread over several devices (an ``hf_device_map`` with >1 entry)."""
        return any(len(getattr(module, "hf_device_map", None) or ()) > 1 for module in model.modules())
