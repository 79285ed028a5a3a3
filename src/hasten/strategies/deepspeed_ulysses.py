"""Sequence parallelism under DeepSpeed (``ParallelismConfig(sp_size=N)`` with a ``deepspeed_plugin``):
DeepSpeed's own Ulysses attention (``UlyssesSPAttentionHF``, ALST), as Accelerate 1.15 runs it.

What Accelerate does (``Accelerator._prepare_deepspeed``, ``sp_backend="deepspeed"``):
``UlyssesSPAttentionHF.register_with_transformers(model, ...)`` builds DeepSpeed's sequence-parallel
groups (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, a Megatron-style ``mpu``) and
overwrites transformers' *own* entry for the model's kernel (``ALL_ATTENTION_FUNCTIONS["sdpa"]``) with
its wrapper, for every model of the process; the ``mpu`` goes to ``deepspeed.initialize(mpu=...)``, so
the engine partitions ZeRO state and reduces gradients over data x sequence processes; and every
prepared dataloader is wrapped in ``UlyssesSPDataLoaderAdapter`` (each sp process gets its slice of the
same batch, labels shifted before the cut).

hasten does the same with its own loop calls and without changing transformers' registry:

* the groups: ``parallel_state_sp.initialize_sequence_parallel`` (checked to be the ranks of hasten's
  ``sp`` mesh axis), handed to ``deepspeed.initialize`` as ``mpu``;
* the attention: a ``UlyssesSPAttentionHF`` per micro-batch size (it is built for one), called from an
  attention function registered under hasten's name ``hasten_ds_ulysses_<kernel>``
  (``attention_routing.route``: ``AttentionInterface.register`` + ``set_attn_implementation``, the
  mechanism of hasten's own sp), so other models of the process keep transformers' ``sdpa``;
* the batch: ``accelerator.maybe_context_parallel`` cuts the buffers (contiguous slices, the
  adapter's cut) and ``accelerator.loss_over_sequence`` gives every process the all-token mean,
  the same two calls as hasten's own sp. How the engine combines the sp processes' gradients
  depends on its ZeRO path (DeepSpeed 0.19.8): stages 0-2, and stage 3 with ``reduce_scatter: false``,
  *sum* them (they divide by the data-parallel size only); stage 3's default reduce-scatter
  *averages* them (it divides by data x sequence processes). ``engine_sums_over_sp`` reads which,
  and ``loss_over_sequence`` gives each process its tokens' share of the gradient accordingly, so
  both equal one process (``tests/test_sequence_split_deepspeed.py``, with SGD, where a factor of
  ``sp_size`` shows).

Refused at ``prepare`` in one line: models whose attention cannot be routed, ``eager``-only kernels
(DeepSpeed refuses them), head counts ``sp_size`` does not divide, and fewer key/value heads than
``sp_size`` (DeepSpeed would then rewrite the attention module's ``num_key_value_groups``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from . import attention_routing as routing

PREFIX = "hasten_ds_ulysses_"
INNER = {"sdpa": "sdpa", "flash_attention_2": "flash_attention_2", "flash_attention_3": "flash_attention_3"}


def sequence_parallel_groups(sp_size: int, sp_mesh: Any) -> Any:
    """DeepSpeed's ``mpu`` (``parallel_state_sp``) for ``sp_size``, its sp group checked against
    hasten's ``sp`` mesh axis (the ranks ``maybe_context_parallel`` cuts the batch over)."""
    import torch.distributed as dist
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    if not (hasattr(mpu, "_SEQUENCE_PARALLEL_GROUP") and hasattr(mpu, "_release_sequence_parallel_groups")):
        import deepspeed

        raise RuntimeError(f"sequence parallelism under DeepSpeed: DeepSpeed {deepspeed.__version__}'s "
                           "parallel_state_sp has no _SEQUENCE_PARALLEL_GROUP / _release_sequence_parallel_groups "
                           "(hasten reads them to reuse or rebuild its sp groups; written for 0.19.8); use that "
                           "DeepSpeed, or FSDP2/DDP with hasten's own sp")
    existing = mpu._SEQUENCE_PARALLEL_GROUP
    if existing is not None and dist.get_world_size(existing) != sp_size:  # an earlier Accelerator's other size
        mpu._release_sequence_parallel_groups()
        existing = None
    if existing is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=sp_size)
    theirs = sorted(dist.get_process_group_ranks(mpu.get_sequence_parallel_group()))
    ours = sorted(dist.get_process_group_ranks(sp_mesh.get_group()))
    if theirs != ours:
        raise ValueError(f"sequence parallelism under DeepSpeed: DeepSpeed's sp group holds ranks {theirs}, hasten's "
                         f"sp axis {ours} (DeepSpeed puts consecutive ranks in one sp group); put sp innermost, "
                         "or use FSDP2 or DDP with hasten's own sp")
    return mpu


class _UlyssesAttention:
    """The attention function hasten registers: DeepSpeed's ``UlyssesSPAttentionHF`` over the sp group,
    one per micro-batch size (DeepSpeed builds it for a fixed batch size), keyed by that size."""

    def __init__(self, inner: str, config: Any, group: Any) -> None:
        self.inner, self.config, self.group = inner, config, group
        self.by_batch: dict[int, Any] = {}

    def _for(self, batch: int) -> Any:
        if batch not in self.by_batch:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
            from transformers import AttentionInterface

            cfg = self.config
            uattn = UlyssesSPAttentionHF(
                attn=AttentionInterface()[self.inner], batch_size=batch, attn_head_count=cfg.num_attention_heads,
                attn_head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                kv_head_count=cfg.num_key_value_heads, num_hidden_layers=cfg.num_hidden_layers,
                process_group=self.group, seq_length_is_variable=True)
            uattn.core_attn_implementation = self.inner
            self.by_batch[batch] = uattn
        return self.by_batch[batch]

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], *args: Any, **kwargs: Any) -> tuple:
        split = routing.current_split("sp")  # raises outside maybe_context_parallel
        routing.check_mask(attention_mask, split)  # a padding mask is refused, an all-ones one dropped
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError("sequence parallelism under DeepSpeed: DeepSpeed's Ulysses attention needs position_ids "
                             "in the model call (model(input_ids=..., position_ids=...)), cut with the other buffers "
                             "by maybe_context_parallel, so that it can rebuild the whole sequence's positions")
        return self._for(query.shape[0])(module, query, key, value, None, *args, **kwargs)


def check_model(model: nn.Module, sp_size: int) -> str:
    """The implementation DeepSpeed's Ulysses will wrap (or the routed name, prepared before); raises
    in one line for models it cannot run."""
    current = routing.check_routable(model, "sp")
    if current.startswith(PREFIX):
        return current
    if current not in INNER:
        raise ValueError(f"sequence parallelism under DeepSpeed runs DeepSpeed's Ulysses attention, which wraps "
                         f"{sorted(INNER)}; {type(model).__name__} uses attn_implementation={current!r} (DeepSpeed "
                         "refuses eager: it needs a full mask); load the model with attn_implementation='sdpa'")
    config = routing.text_config(model)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not heads or heads % sp_size:
        raise ValueError(f"sequence parallelism: {type(model).__name__} has num_attention_heads={heads}, not a "
                         f"multiple of sp_size={sp_size}; use an sp_size that divides {heads}")
    if not kv_heads or kv_heads % sp_size:
        raise ValueError(f"sequence parallelism under DeepSpeed: {type(model).__name__} has num_key_value_heads="
                         f"{kv_heads}, not a multiple of sp_size={sp_size} (DeepSpeed's Ulysses would rewrite the "
                         "attention modules' num_key_value_groups to repeat them); use an sp_size that divides "
                         f"{kv_heads}, or FSDP2/DDP with hasten's own sp, which repeats the heads itself")
    return current


def prepare_model(model: nn.Module, sp_size: int, group: Any) -> str:
    """Route ``model``'s attention through DeepSpeed's Ulysses over ``group``; returns the routed name."""
    current = check_model(model, sp_size)
    if current.startswith(PREFIX):
        return current  # prepared before
    name = PREFIX + INNER[current]
    routing.route(model, name, _UlyssesAttention(INNER[current], routing.text_config(model), group), "sp")
    return name


def sequence_parallel_engine(model: nn.Module, sp_size: int, mesh: Any) -> dict[str, Any]:
    """Before ``deepspeed.initialize``: DeepSpeed's sp groups and ``model`` routed through its Ulysses
    attention; returns the keyword arguments for ``deepspeed.initialize`` (``mpu``)."""
    check_model(model, sp_size)  # before any group is built
    mpu = sequence_parallel_groups(sp_size, mesh["sp"])
    prepare_model(model, sp_size, mpu.get_sequence_parallel_group())
    return {"mpu": mpu}


def engine_sums_over_sp(engine: Any) -> bool:
    """True when ``engine`` sums the sp processes' gradients, False when it averages them (ZeRO-3's
    reduce-scatter path), read from DeepSpeed 0.19.8's reduction code (see the module's docstring)."""
    return not (engine.zero_optimization_stage() == 3 and bool(engine.zero_reduce_scatter()))


def no_sequence_parallel() -> dict[str, Any]:
    """An engine without sp: an sp engine built before in this process left its ``mpu`` in
    ``deepspeed.utils.groups`` (an engine sets it and never clears it), from which this engine would take
    sp groups and reduce its gradients as sp gradients; that leftover is cleared. Returns no arguments."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    sp_state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if groups is not None and sp_state is not None and getattr(groups, "mpu", None) is sp_state:
        groups.mpu = None
    return {}
