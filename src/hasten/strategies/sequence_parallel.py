"""Ulysses sequence parallelism (``sp_size > 1``): attention over whole sequences, split by heads.

Every ``sp`` process holds a contiguous slice of each sequence (``accelerator.maybe_context_parallel``
cuts the batch's buffers). In each attention layer, queries, keys and values ``(batch, heads,
sequence / sp, head_dim)`` go through one all-to-all to ``(batch, heads / sp, sequence, head_dim)``:
every process then runs the model's own attention kernel over the whole sequence for its share of
the heads, and a second all-to-all brings the output back to the sequence split. The rest of the
model (projections, MLP, norms, the loss) runs on the process's tokens only. Backward is the
same two all-to-alls reversed.

The attention is hooked through transformers' attention interface (``attention_routing.route``):
the model's implementation ``sdpa`` (or ``eager``: the same causal softmax) becomes
``hasten_ulysses_sdpa``, ``flash_attention_2`` becomes ``hasten_ulysses_flash_attention_2``; the
name says which kernel runs inside. The ``sp`` processes hold the same parameters and read the same
batch (``sp`` is not a data axis); their gradients are averaged with the data-parallel ones (DDP
over every process, FSDP2 over the flattened ``dp_shard_sp``), so the loss each process returns
must be its share of the loss over all tokens: ``loss_over_sequence`` (``accelerator.loss_over_sequence``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import attention_routing as routing

PREFIX = "hasten_ulysses_"
INNER = {"sdpa": "sdpa", "eager": "sdpa", "flash_attention_2": "flash_attention_2",
         "flash_attention_3": "flash_attention_3"}


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to process ``i``; chunk ``i`` of the result came from process ``i``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # x contiguous: so is out (empty_like keeps a permuted view's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def _sequence_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(B, H, s, D) on each process (its sequence slice) -> (B, H/size, size*s, D) (its head share)."""
    b, h, s, d = x.shape
    parts = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4)  # [destination, B, h, s, D]
    got = _all_to_all(parts, group)  # [source = sequence slice, B, h, s, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _heads_to_sequence(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(B, h, size*s, D) (a head share over the whole sequence) -> (B, size*h, s, D) (a sequence slice)."""
    b, h, n, d = x.shape
    parts = x.reshape(b, h, size, n // size, d).permute(2, 0, 1, 3, 4)  # [destination = slice, B, h, s, D]
    got = _all_to_all(parts, group)  # [source = head share, B, h, s, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, size * h, n // size, d)


class _Exchange(torch.autograd.Function):
    """One of the two all-to-alls (``forward`` of the pair), whose gradient is the other one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        back = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return back(grad, ctx.group, ctx.size), None, None, None


def ulysses_attention(inner: str) -> Any:
    """The attention function that runs ``inner`` (a transformers implementation) over whole sequences."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        from transformers import AttentionInterface

        split = routing.current_split("sp")
        routing.check_mask(attention_mask, split)
        if key.shape[1] % split.size:  # too few key/value heads to share out: repeat them as the query heads
            key, value = routing.repeat_heads(key, value, query.shape[1])
        q, k, v = (_Exchange.apply(t, split.group, split.size, True) for t in (query, key, value))
        kwargs.pop("is_causal", None)
        out, _ = AttentionInterface()[inner](module, q, k, v, None, dropout=dropout, scaling=scaling,
                                              is_causal=True, **kwargs)
        out = out.transpose(1, 2)  # transformers' kernels return (B, S, H, D)
        return _Exchange.apply(out, split.group, split.size, False).transpose(1, 2).contiguous(), None

    return attention


def prepare_model(model: nn.Module, sp_size: int) -> str:
    """Route ``model``'s attention through Ulysses over ``sp_size`` processes; returns the routed name.
    Refuses (one line) models whose attention cannot be routed and head counts ``sp_size`` cannot divide."""
    current = routing.check_routable(model, "sp")
    if current.startswith(PREFIX):
        return current  # prepared before (a second prepare of the same model)
    if current not in INNER:
        raise ValueError(f"sequence parallelism (sp_size={sp_size}) runs the model's attention kernel on a share of "
                         f"the heads; {type(model).__name__} uses attn_implementation={current!r}, which it cannot "
                         f"wrap; load it with one of {sorted(INNER)}")
    config = routing.text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    if not heads or heads % sp_size:
        raise ValueError(f"sequence parallelism: {type(model).__name__} has num_attention_heads={heads}, not a multiple "
                         f"of sp_size={sp_size} (each sp process runs attention for heads / sp_size heads); use an "
                         f"sp_size that divides {heads}")
    name = PREFIX + INNER[current]
    routing.route(model, name, ulysses_attention(INNER[current]), "sp")
    return name


def shard(group: Any, buffers: list[torch.Tensor], seq_dims: list[int]) -> list[torch.Tensor]:
    """This process's contiguous slice of each buffer along its sequence dimension."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    shards = []
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        if buffer.shape[dim] % size:
            raise ValueError(f"maybe_context_parallel: buffer {i} has sequence length {buffer.shape[dim]} (dim {dim}), "
                             f"not a multiple of sp_size={size}; pad the sequences to a multiple of {size} (labels "
                             "-100 on the padding)")
        shards.append(buffer.chunk(size, dim=dim)[rank].clone())
    return shards


class _TokenMean(torch.autograd.Function):
    """Forward: the mean over every process's tokens (``sum(loss_r * n_r) / sum(n_r)``), equal on all.
    Backward: process ``r`` receives the whole group's gradient times ``n_r / N``, its tokens' share."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, tokens: torch.Tensor, group: Any, summed: bool) -> torch.Tensor:
        both = torch.stack([loss.detach().double() * tokens.double(), tokens.double()])
        dist.all_reduce(both, group=group)
        ctx.group, ctx.share = group, (tokens.double() / both[1].clamp(min=1)).to(loss.dtype)
        ctx.divide = dist.get_world_size(group) if summed else 1
        return (both[0] / both[1].clamp(min=1)).to(loss.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad * ctx.share / ctx.divide, None, None, None


def loss_over_sequence(loss: torch.Tensor, tokens: Any, group: Any, summed: bool = False) -> torch.Tensor:
    """The mean over all tokens of the processes of ``group`` of a loss whose value is this process's
    mean over ``tokens`` of its own tokens; backward gives each process its tokens' share, so that
    averaging gradients over the group (as DDP and FSDP2 do) gives the gradient of the all-token mean.
    ``summed``: the engine sums the group's gradients instead (DeepSpeed over its sp processes), so
    each process's share is divided by the group's size."""
    tokens = torch.as_tensor(tokens, device=loss.device)
    return _TokenMean.apply(loss, tokens, group, summed)
