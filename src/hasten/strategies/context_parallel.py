"""Context parallelism: one sequence split over the ``cp`` dimension of the mesh (CUDA, and the CPU).

Inside ``Accelerator.maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)`` torch's
``context_parallel`` shards the given buffers (input ids, labels, position ids) along their
sequence dimension over the ``cp`` processes, in place, and routes
``scaled_dot_product_attention`` through its ring attention, which passes keys and values
between the ``cp`` processes (all-gather or all-to-all: ``cp_comm_strategy``). Every ``cp``
process of a data-parallel replica receives the same batch (the data layer reads the mesh's
data-parallel rank), and FSDP2 shards the model over the flattened ``dp_shard_cp`` dimension, so
gradients are averaged over the data-parallel and context-parallel processes together.

Written against torch 2.13's API and Accelerate 1.15's behaviour. The CUDA path (torch's
``context_parallel`` as it is) has not yet run on a GPU; the CPU path (torch's ring algorithm with
the CPU kernel, ``ring_attention.py``, routed through transformers' attention interface) is tested
against one process (``tests/test_sequence_split.py``). Sequence parallelism (Ulysses, ``sp``) shares
the buffer split of ``maybe_context_parallel`` (``split_for_sequence_parallel``).
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


CPU_RING = "hasten_cp_ring"  # the attention implementation the CPU path routes models to


def cpu_ring_attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any,
                       dropout: float = 0.0, scaling: Optional[float] = None, **kwargs: Any) -> tuple:
    """The CPU path's attention (a transformers attention function): torch's ring with the CPU kernel."""
    from . import attention_routing as routing
    from .ring_attention import ring_attention

    split = routing.current_split("cp")
    routing.check_mask(attention_mask, split)
    if dropout:
        raise ValueError(f"context parallelism: attention dropout {dropout} is not applied by ring attention; set the "
                         "model's attention_dropout to 0")
    key, value = routing.repeat_heads(key, value, query.shape[1])
    out = ring_attention(query, key, value, split.group, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def prepare_model(model: nn.Module, handler: Any, device_type: str = "cuda") -> None:
    """Make ``model`` run under context parallelism: its attention must be causal, without a mask.

    On CUDA, torch's ``context_parallel`` replaces ``scaled_dot_product_attention`` inside
    ``maybe_context_parallel``: ring attention can only express full causal attention, so the
    ``attention_mask`` that transformers passes to each ``self_attn`` module is dropped in favour of
    ``is_causal=True``. On the CPU, where torch's dispatcher has no ring for the CPU kernel, the
    model's attention is routed (transformers' attention interface) to ``cpu_ring_attention``:
    torch's ring algorithm called with the CPU kernel (``ring_attention.py``). Either way a model
    with sliding-window or chunked layers would silently train with the wrong mask, so it is refused.
    """
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from . import attention_routing as routing

    set_rotate_method(comm_strategy(handler))
    if device_type == "cpu":
        current = routing.check_routable(model, "cp")
        if current not in ("sdpa", "eager", CPU_RING):
            raise ValueError(f"context parallelism on the CPU runs torch's ring attention with the CPU SDPA kernel, but "
                             f"{type(model).__name__} uses attn_implementation={current!r}; load it with "
                             "attn_implementation='sdpa'")
        routing.route(model, CPU_RING, cpu_ring_attention, "cp")
        return
    routing.check_full_causal(model, "cp")
    config = routing.text_config(model)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "sdpa"):
        raise ValueError(f"context parallelism (cp_size > 1) replaces torch's scaled_dot_product_attention, but "
                         f"{type(model).__name__} uses attn_implementation={implementation!r}; load it with "
                         "attn_implementation='sdpa'")

    def causal_without_mask(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
            kwargs["is_causal"] = True
        return args, kwargs

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(causal_without_mask, with_kwargs=True, prepend=True)


def _check_buffers(buffers: list, dims: list[int]) -> None:
    if len(dims) != len(buffers):
        raise ValueError(f"maybe_context_parallel: {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give "
                         "the sequence dimension of each buffer")


@contextlib.contextmanager
def _in_place(buffers: list, shards: list, no_restore_buffers: Optional[set]) -> Iterator[None]:
    """Each buffer holds its shard inside the block (as torch's ``context_parallel``), restored after it
    unless it is in ``no_restore_buffers``."""
    keep = [b for b in (no_restore_buffers or ())]
    originals = [None if any(b is k for k in keep) else b.clone() for b in buffers]
    for buffer, piece in zip(buffers, shards):
        buffer.resize_(piece.shape)
        buffer.copy_(piece)
    try:
        yield
    finally:
        for buffer, original in zip(buffers, originals):
            if original is not None:
                buffer.resize_(original.shape)
                buffer.copy_(original)


@contextlib.contextmanager
def sharded_sequences(cp_mesh: Any, buffers: Optional[list] = None, buffer_seq_dims: Optional[list[int]] = None,
                      no_restore_buffers: Optional[set] = None) -> Iterator[None]:
    """Context parallelism over ``cp_mesh``: ``buffers`` sharded along ``buffer_seq_dims`` (restored on
    exit, except ``no_restore_buffers``). On CUDA torch's ``context_parallel`` (SDPA replaced by ring
    attention); on the CPU the same cut by torch's own sharding, and the routed ring attention."""
    from torch.distributed.tensor.experimental._attention import _cp_options

    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    _check_buffers(buffers, dims)
    # With load balancing (torch's default) each process takes two of 2 x cp_size chunks.
    parts = cp_mesh.size() * (2 if _cp_options.enable_load_balance else 1)
    for i, (buffer, dim) in enumerate(zip(buffers, dims)):
        if buffer.shape[dim] % parts:
            raise ValueError(f"maybe_context_parallel: buffer {i} has sequence length {buffer.shape[dim]} (dim {dim}), "
                             f"not a multiple of {parts} (the cp chunks); pad the sequences to a multiple of {parts}")
    if cp_mesh.device_type != "cpu":
        from torch.distributed.tensor.experimental import context_parallel

        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=no_restore_buffers):
            yield
        return
    from .attention_routing import Split, split_sequences
    from .ring_attention import shard_sequences

    with _in_place(buffers, shard_sequences(cp_mesh, buffers, dims), no_restore_buffers):
        with split_sequences(Split("cp", cp_mesh.get_group(), cp_mesh.size())):
            yield


@contextlib.contextmanager
def split_for_sequence_parallel(sp_mesh: Any, buffers: Optional[list] = None,
                                buffer_seq_dims: Optional[list[int]] = None,
                                no_restore_buffers: Optional[set] = None) -> Iterator[None]:
    """Sequence parallelism (Ulysses) over ``sp_mesh``: each buffer keeps its contiguous slice."""
    from .attention_routing import Split, split_sequences
    from .sequence_parallel import shard

    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    _check_buffers(buffers, dims)
    group = sp_mesh.get_group()
    with _in_place(buffers, shard(group, buffers, dims), no_restore_buffers):
        with split_sequences(Split("sp", group, sp_mesh.size())):
            yield
