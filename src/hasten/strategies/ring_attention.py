"""Context parallelism's attention on the CPU: torch's own ring algorithm, driven with the CPU kernel.

torch 2.13's ``context_parallel`` routes ``scaled_dot_product_attention`` through DTensor and ring
attention only for the CUDA kernels (flash, memory-efficient, cuDNN). On the CPU, SDPA dispatches
``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding strategy, so
torch's context manager fails at the first attention call, measured with gloo on 2 processes::

    NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
    have a sharding strategy registered.

(forcing the math backend fails too: ``aten.add.Tensor got mixed torch.Tensor and DTensor``). The
ring itself does not depend on the kernel: torch's ``_templated_ring_attention`` and
``_templated_ring_attention_backward`` take the attention op as an argument, exchange keys and
values with torch's rotaters (all-gather or all-to-all, ``set_rotate_method``) and merge the
partial results by their log-sum-exp, with the head-tail load balancing of causal sequences. This
module calls them with the CPU flash kernel and its backward, inside one ``autograd.Function``
(torch wires its ring into autograd through DTensor's dispatcher, which is the part that is
missing on the CPU). Nothing in torch is replaced or registered; on CUDA, torch's
``context_parallel`` is used unchanged (``context_parallel.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

SEQ_DIM = 2  # (batch, heads, sequence, head_dim): the layout the attention kernels take


# torch's private ring-attention pieces this module drives (written against torch 2.13).
_NEEDED = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options", "_context_parallel_buffers")


def _unsupported(what: str) -> RuntimeError:
    return RuntimeError(f"context parallelism on the CPU drives torch's private ring attention ({what}), written "
                        f"against torch 2.13; torch {torch.__version__} differs. Use torch 2.13 for cp on the CPU, "
                        "run context parallelism on CUDA (torch's public context_parallel), or use sp_size instead")


def _torch_ring() -> Any:
    """torch's ring-attention module, checked: one clear error naming the torch version where it changed."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError as e:
        raise _unsupported(f"torch.distributed.tensor.experimental._context_parallel._attention: {e}") from None
    missing = [name for name in _NEEDED if not hasattr(_attention, name)]
    if missing:
        raise _unsupported(f"_attention lacks {missing}")
    return _attention


def _call(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A call into torch's private ring code; a changed signature is named as such, not as a wrong result."""
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        raise _unsupported(f"{what}: {e}") from None


def load_balancing() -> bool:
    """Whether torch's ring expects head-tail load-balanced shards (its ``_cp_options``)."""
    return bool(_torch_ring()._cp_options.enable_load_balance)


class _CPURingAttention(torch.autograd.Function):
    """Causal ring attention over ``group`` with the CPU flash kernel (forward and backward)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                scale: Optional[float]) -> torch.Tensor:
        ring = _torch_ring()
        aten = torch.ops.aten
        out, lse = _call("_templated_ring_attention", ring._templated_ring_attention,
            group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu.default, query, key, value,
            is_causal=True, dropout_p=0.0, scale=scale)[:2]
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.scale, ctx.balanced = group, scale, load_balancing()
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        query, key, value, out, lse = ctx.saved_tensors
        if load_balancing() != ctx.balanced:  # torch's option is global: backward must cut as forward did
            raise RuntimeError("context parallelism: torch's load-balancing option changed between forward and "
                               "backward; run backward inside the same accelerator.maybe_context_parallel block")
        ring = _torch_ring()
        grads = _call("_templated_ring_attention_backward", ring._templated_ring_attention_backward,
            ctx.group, SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out.contiguous(), grad_out_name="grad_out", query=query, key=key, value=value, out=out,
            logsumexp=lse, is_causal=True, dropout_p=0.0, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this process's query shard against every process's keys and values.

    ``query``/``key``/``value``: ``(batch, heads, local sequence, head_dim)``, the same number of
    heads (repeat grouped key/value heads first); the local sequence is this process's shard as
    ``shard_sequences`` cut it. Returns ``(batch, heads, local sequence, head_dim)``.
    """
    if query.device.type != "cpu":
        raise ValueError(f"ring_attention is the CPU path of context parallelism; tensors on {query.device.type} "
                         "go through torch's context_parallel")
    return _CPURingAttention.apply(query, key, value, group, scale)


def shard_sequences(cp_mesh: Any, buffers: list[torch.Tensor], seq_dims: list[int]) -> list[torch.Tensor]:
    """This process's shard of each buffer, cut by torch's ``_context_parallel_buffers`` as its
    ``context_parallel`` cuts them: with torch's default load balancer (head-tail: ``2 x cp`` chunks,
    process ``i`` keeps chunks ``i`` and ``2 x cp - 1 - i``) when load balancing is on, in contiguous
    equal shards otherwise."""
    ring = _torch_ring()
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _create_default_load_balancer,
        )
    except ImportError as e:
        raise _unsupported(f"the default load balancer: {e}") from None

    if not buffers:
        return []
    size = cp_mesh.size()
    lengths = {b.shape[d] for b, d in zip(buffers, seq_dims)}
    if len(lengths) != 1:
        raise ValueError(f"maybe_context_parallel: the buffers have different sequence lengths {sorted(lengths)}; "
                         "give buffers of one sequence length (inputs, labels and positions of one batch)")
    length = lengths.pop()
    balancer = _create_default_load_balancer(length, size, buffers[0].device)
    if load_balancing() and balancer is None:
        raise ValueError(f"maybe_context_parallel: sequence length {length} is not a multiple of {2 * size} "
                         f"(2 x cp_size, the load-balanced chunks); pad the sequences to a multiple of {2 * size}")
    return _call("_context_parallel_buffers", ring._context_parallel_buffers, cp_mesh, list(buffers), list(seq_dims),
                 balancer)
