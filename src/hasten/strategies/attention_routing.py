"""A transformers model's attention routed through hasten's sequence-split attention (cp on the CPU, sp).

Transformers calls every attention layer's kernel through its attention interface
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``). Context parallelism on the CPU and
Ulysses sequence parallelism register their attention function there under their own name
(``AttentionInterface.register``) and switch the model to it with ``set_attn_implementation``:
no method of the model is replaced. A model whose attention does not go through that interface
cannot be routed and is refused at ``prepare``, as are models whose layers need a mask other than
full causal attention (sliding windows, chunks), which a split sequence cannot apply.

The routed attention works on sequences split over processes, so it only runs where the loop has
split them: inside ``accelerator.maybe_context_parallel`` (``split_sequences`` below marks that
block, per thread, with the process group). Called outside it, it raises instead of computing
attention over a sequence it would take for a shard.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torch import nn

AXIS_NAMES = {"cp": "context parallelism (cp_size > 1)", "sp": "sequence parallelism (sp_size > 1)"}


@dataclass(frozen=True)
class Split:
    """The sequences of the running block are split over ``group`` (``axis``: "cp" or "sp")."""

    axis: str
    group: Any
    size: int


_SPLIT: ContextVar[Optional[Split]] = ContextVar("hasten_sequence_split", default=None)


@contextlib.contextmanager
def split_sequences(split: Split) -> Iterator[None]:
    """Mark the block as running on split sequences (what the routed attention functions read)."""
    token = _SPLIT.set(split)
    try:
        yield
    finally:
        _SPLIT.reset(token)


def current_split(axis: str) -> Split:
    """The split of the running block; raises when the attention runs outside one."""
    split = _SPLIT.get()
    if split is None or split.axis != axis:
        raise RuntimeError(f"{AXIS_NAMES[axis]}: the model's attention ran outside accelerator.maybe_context_parallel"
                           f"(buffers=..., buffer_seq_dims=...); split each batch's sequences with it around forward "
                           f"and backward (its attention would otherwise treat whole sequences as shards)")
    return split


def text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_full_causal(model: nn.Module, axis: str) -> None:
    """Refuse models with sliding-window or chunked layers: split attention applies full causal masks only."""
    config = text_config(model)
    kinds = getattr(config, "layer_types", None)
    other = sorted({k for k in kinds if k != "full_attention"}) if kinds else (
        ["sliding_attention"] if getattr(config, "sliding_window", None) else [])
    if other:
        raise ValueError(f"{AXIS_NAMES[axis]} cannot run {type(model).__name__}: its layers of type {other} need a "
                         f"mask other than full causal, which attention over split sequences cannot apply; use a "
                         f"full-attention model or {axis}_size=1")


def check_routable(model: nn.Module, axis: str) -> str:
    """The model's current attention implementation, after checking that it can be routed."""
    name = type(model).__name__
    config = text_config(model)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if config is None or not hasattr(model, "set_attn_implementation") or not (can_set and can_set()):
        raise ValueError(f"{AXIS_NAMES[axis]} routes attention through transformers' attention interface "
                         f"(ALL_ATTENTION_FUNCTIONS), but {name}'s attention does not go through it; use a transformers "
                         f"model whose attention layers call ALL_ATTENTION_FUNCTIONS.get_interface, or {axis}_size=1")
    check_full_causal(model, axis)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def caller_mask(attention_mask: Any = None, **_: Any) -> Any:
    """The mask function of a routed implementation: the caller's own 2-D mask (or None), which the
    attention function checks. (Without one registered, transformers drops the caller's mask for an
    implementation it does not know, and padding would go unnoticed.)"""
    return attention_mask


def route(model: nn.Module, name: str, function: Callable, axis: str) -> None:
    """Register ``function`` as the attention implementation ``name`` (and ``caller_mask`` as its mask
    function) and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, caller_mask)
    model.set_attn_implementation(name)
    if getattr(text_config(model), "_attn_implementation", None) != name:
        raise ValueError(f"{AXIS_NAMES[axis]}: {type(model).__name__} kept attn_implementation="
                         f"{text_config(model)._attn_implementation!r} after set_attn_implementation({name!r}); its "
                         f"attention cannot be routed, use {axis}_size=1")


def check_mask(attention_mask: Any, split: Split) -> None:
    """Split attention is full causal attention. Transformers hands a routed implementation the
    caller's own mask (it builds masks only for implementations it knows): a 2-D mask that masks
    nothing is accepted, a mask with padding or any other mask is refused. (Documents packed into one row are not
    separated either: the row is one causal sequence.) The processes agree
    first (one all-reduce, only when a mask is given), so all of them raise, none waits on a collective."""
    if attention_mask is None:
        return
    import torch
    import torch.distributed as dist

    fine = attention_mask.dim() == 2 and bool((attention_mask != 0).all())
    flag = torch.tensor([0.0 if fine else 1.0], device=attention_mask.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=split.group)
    if flag.item():
        raise ValueError(f"{AXIS_NAMES[split.axis]}: the batch has an attention mask with masked (padding) positions "
                         f"or of shape {tuple(attention_mask.shape)} on some process, which attention over split "
                         "sequences cannot apply (it attends causally over the whole row); drop the attention_mask "
                         "and pad with tokens whose labels are -100")


def repeat_heads(key: Any, value: Any, heads: int) -> tuple[Any, Any]:
    """Grouped key/value heads repeated to ``heads`` (as transformers' ``repeat_kv``)."""
    groups = heads // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
