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
        """Accelerate's loader for DeepSpeed's Ulysses. At ``sp_size`` 1 it returns ``dl`` as it is (as
        Accelerate's); above, hasten's Ulysses splits each batch's sequences in the loop instead, with
        ``accelerator.maybe_context_parallel(buffers=..., buffer_seq_dims=...)``, so it is refused with that fix."""
        sp_size = getattr(self.parallelism_config, "sp_size", 1) or 1
        if sp_size > 1:
            raise ValueError(f"deepspeed_ulysses_dl_adapter: sp_size={sp_size}: hasten's sequence parallelism splits the "
                             "sequences inside the loop; keep the prepared loader and wrap forward and backward in "
                             "accelerator.maybe_context_parallel(buffers=[input_ids, shift_labels, position_ids], "
                             "buffer_seq_dims=[1, 1, 1])")
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
        """Run the block with each sequence split over the context-parallel (``cp_size > 1``) or
        sequence-parallel (``sp_size > 1``) processes.

        ``buffers`` (input ids, labels, position ids; not parameters) are sharded in place along their
        ``buffer_seq_dims`` and restored on exit, except those in ``no_restore_buffers``; attention
        must be causal, without a padding mask. cp cuts each sequence into ``2 x cp_size`` chunks (load
        balancing), sp into ``sp_size`` contiguous slices. Enter it anew for every step, around forward
        and backward. With both sizes 1 (or no ``parallelism_config``) it changes nothing (one warning
        says so), so the same loop runs with and without them.
        """
        config = self.parallelism_config
        cp, sp = (getattr(config, "cp_size", 1), getattr(config, "sp_size", 1)) if config is not None else (1, 1)
        if cp == 1 and sp == 1:
            from .logging import get_logger

            get_logger(__name__).warning_once("maybe_context_parallel: context and sequence parallelism are off "
                                              "(cp_size=1, sp_size=1); the block runs unchanged. Set "
                                              "ParallelismConfig(cp_size=N) or (sp_size=N) to turn one on")
            yield
            return
        from .strategies import context_parallel

        if sp > 1:
            with context_parallel.split_for_sequence_parallel(self.strategy.mesh["sp"], buffers, buffer_seq_dims,
                                                              no_restore_buffers):
                yield
            return
        with context_parallel.sharded_sequences(self.strategy.mesh["cp"], buffers, buffer_seq_dims, no_restore_buffers):
            yield

    def loss_over_sequence(self, loss: Any, num_tokens: Any) -> Any:
        """The mean over all tokens of the sequences split over the cp or sp processes, from this
        process's ``loss`` (the mean over its ``num_tokens`` tokens, e.g. labels other than -100).

        Every process of a cp/sp group gets the same value; backward gives each its tokens' share, so
        the gradients the engine averages are those of the all-token mean, also when the processes
        hold different numbers of tokens. With cp and sp off it returns ``loss`` unchanged.
        """
        config = self.parallelism_config
        axis = "sp" if getattr(config, "sp_size", 1) > 1 else "cp" if getattr(config, "cp_size", 1) > 1 else None
        if axis is None:
            return loss
        from .strategies.sequence_parallel import loss_over_sequence

        summed = False
        if axis == "sp" and getattr(self.strategy, "engines", None):  # DeepSpeed: sum or mean over sp, by ZeRO path
            from .strategies.deepspeed_ulysses import engine_sums_over_sp

            summed = engine_sums_over_sp(self.strategy.engines[0])
        return loss_over_sequence(loss, num_tokens, self.strategy.mesh[axis].get_group(), summed=summed)

    @property
    def sequence_parallel_rank(self) -> int:
        return self._coordinate("sp", "Sequence")

    def verify_device_map(self, model: Any) -> bool:
        """Whether ``model`` was loaded spread over several devices (an ``hf_device_map`` with >1 entry)."""
        return any(len(getattr(module, "hf_device_map", None) or ()) > 1 for module in model.modules())
