"""Context parallelism: one sequence split over the ``cp`` dimension of the mesh (CUDA only).

Inside ``Accelerator.maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)`` torch's
``context_parallel`` shards the given buffers (input ids, labels, position ids) along their
sequence dimension over the ``cp`` processes, in place, and routes
``scaled_dot_product_attention`` through its ring attention, which passes keys and values
between the ``cp`` processes (all-gather or all-to-all: ``cp_comm_strategy``). Every ``cp``
process of a data-parallel replica receives the same batch (the data layer reads the mesh's
data-parallel rank), and FSDP2 shards the model over the flattened ``dp_shard_cp`` dimension, so
gradients are averaged over the data-parallel and context-parallel processes together.

Written against torch 2.13's API and Accelerate 1.15's behaviour; not yet run on a GPU
(``cp_size > 1`` is refused on the CPU before any process-group work).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

from torch import nn

COMM_STRATEGIES = ("allgather", "alltoall")


def comm_strategy(handler: Any) -> str:
    """How keys and values travel between the ``cp`` processes: the handler's ``cp_comm_strategy``
    (Accelerate's ``TorchContextParallelConfig``), else ``PARALLELISM_CONFIG_CP_COMM_STRATEGY``, else allgather."""
    value = getattr(handler, "cp_comm_strategy", None) or os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY",
                                                                         "allgather")
    if value not in COMM_STRATEGIES:
        raise ValueError(f"Invalid cp_comm_strategy: {value} (ParallelismConfig); use one of {list(COMM_STRATEGIES)}")
    return value


def prepare_model(model: nn.Module, handler: Any) -> None:
    """Make ``model`` run under context parallelism: its attention must be causal SDPA without a mask.

    Ring attention can only express full causal attention, so the ``attention_mask`` that
    transformers passes to each ``self_attn`` module is dropped in favour of ``is_causal=True``;
    a model with sliding-window or chunked layers would silently train with the wrong mask, so
    it is refused.
    """
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layer_types", None)
    other = sorted({k for k in kinds if k != "full_attention"}) if kinds else (
        ["sliding_attention"] if getattr(config, "sliding_window", None) else [])
    if other:
        raise ValueError(f"context parallelism (cp_size > 1) cannot run {type(model).__name__}: its layers of type "
                         f"{other} need a mask other than full causal, which ring attention cannot apply; use a "
                         "full-attention model or cp_size=1")
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "sdpa"):
        raise ValueError(f"context parallelism (cp_size > 1) replaces torch's scaled_dot_product_attention, but "
                         f"{type(model).__name__} uses attn_implementation={implementation!r}; load it with "
                         "attn_implementation='sdpa'")
    set_rotate_method(comm_strategy(handler))

    def causal_without_mask(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
            kwargs["is_causal"] = True
        return args, kwargs

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(causal_without_mask, with_kwargs=True, prepend=True)


@contextlib.contextmanager
def sharded_sequences(cp_mesh: Any, buffers: Optional[list] = None, buffer_seq_dims: Optional[list[int]] = None,
                      no_restore_buffers: Optional[set] = None) -> Iterator[None]:
    """torch's ``context_parallel`` over ``cp_mesh``: ``buffers`` sharded along ``buffer_seq_dims``
    (restored on exit, except ``no_restore_buffers``), SDPA replaced by ring attention."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    if len(dims) != len(buffers):
        raise ValueError(f"maybe_context_parallel: {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give "
                         "the sequence dimension of each buffer")
    # With load balancing (torch's default) each process takes two of 2 x cp_size chunks.
    parts = cp_mesh.size() * (2 if _cp_options.enable_load_balance else 1)
    for i, (buffer, dim) in enumerate(zip(buffers, dims)):
        if buffer.shape[dim] % parts:
            raise ValueError(f"maybe_context_parallel: buffer {i} has sequence length {buffer.shape[dim]} (dim {dim}), "
                             f"not a multiple of {parts} (the cp chunks); pad the sequences to a multiple of {parts}")
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=no_restore_buffers):
        yield
