"""Activation checkpointing of a model's repeated blocks, applied by the strategies at ``prepare``.

A transformer's activations grow with depth, batch and sequence length; checkpointing a block keeps
only its input for backward and recomputes the rest when backward reaches it. The setting comes from
``ActivationCheckpointingKwargs`` (any strategy but DeepSpeed) or from the FSDP plugin's
``activation_checkpointing`` flag; ``hasten.planning`` turns both into one ``Plan`` field and each
strategy calls ``checkpoint_blocks`` at the point of its wrapping where the checkpoint wrapper is
correct: after the tensor-parallel plan (which matches module names the wrapper would change),
before ``fully_shard`` and before DDP.

Modes:
- ``full``: every block is recomputed in backward; only its input is kept.
- ``every_k``: blocks ``0, k, 2k, ...`` are checkpointed, the others keep all they save.
- ``selective``: each block keeps the outputs of its expensive ops (matrix products, attention,
  reduce-scatter) and recomputes the cheap ones (norms, activations, element-wise), through
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
``offload`` moves what the checkpointed blocks keep through autograd (their inputs) to host memory
(pinned, copied on the current stream) and back when backward needs it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .compilation import is_repeated_blocks

# What torch's CheckpointWrapper adds to the names of the parameters of the block it wraps.
_WRAPPED = "_checkpoint_wrapped_module."


def strip_checkpoint_prefix(name: str) -> str:
    """A parameter's or module's name as the model has it, without the checkpoint wrappers' part."""
    return name.replace(_WRAPPED, "")


# -- which modules are the blocks ---------------------------------------------------------------
def find_blocks(model: nn.Module, class_names: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The repeated blocks of ``model``, outermost first, none inside another.

    ``class_names`` (``ActivationCheckpointingKwargs.block_classes``, or the FSDP plugin's
    ``transformer_cls_names_to_wrap``) names their classes; else transformers' ``_no_split_modules``;
    else the items of every ``ModuleList`` of one class. No blocks is an error: checkpointing nothing
    would silently keep every activation the user asked to drop.
    """
    names = list(class_names or [])
    source = "block_classes"
    if not names:
        names = [n for n in (getattr(model, "_no_split_modules", None) or []) if isinstance(n, str)]
        source = "_no_split_modules"
    if names:
        present = {type(m).__name__ for m in model.modules()}
        blocks = _outermost(model, lambda m: type(m).__name__ in names)
        if blocks:
            return blocks
        if source == "block_classes":
            raise ValueError(f"activation checkpointing: block_classes={names} names no module class of "
                             f"{type(model).__name__}; pick from {sorted(present)[:20]}")
    lists = [m for m in model.modules() if is_repeated_blocks(m)]
    blocks = _outermost(model, lambda m: any(m is item for lst in lists for item in lst))
    if not blocks:
        raise ValueError(f"activation checkpointing: {type(model).__name__} has no repeated blocks to checkpoint (no "
                         "_no_split_modules and no nn.ModuleList of one module class); name their classes with "
                         "ActivationCheckpointingKwargs(block_classes=['MyBlock']), or drop the setting")
    return blocks


def _outermost(model: nn.Module, chosen: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules below ``model`` for which ``chosen`` holds, skipping those inside one already taken."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if chosen(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


# -- the selective policy -----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def saved_ops() -> frozenset:
    """The ops whose outputs a selectively checkpointed block keeps: matrix products, attention
    kernels, float8 products and the reduce-scatter of sequence parallelism (expensive to redo);
    everything else is recomputed."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward"]
    ops = [getattr(aten, n).default for n in names if hasattr(aten, n)]
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.append(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep the outputs of ``saved_ops``; recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy)


# -- offload to host memory ---------------------------------------------------------------------
class HostOffload:
    """A ``saved_tensors_hooks`` pair that keeps saved tensors in host memory until backward.

    A device tensor is copied into pinned host memory on the current stream (``non_blocking``: the
    copy is ordered before any later kernel that reuses its memory, and the pinned block is not
    reused until the copy back has run) and copied back to its device when backward unpacks it. A
    tensor already in host memory is kept as it is. Tensor subclasses (DTensor) stay where they are.
    ``moved`` / ``kept`` count the bytes of each kind, for tests and measurements.
    """

    def __init__(self) -> None:
        self.moved = 0
        self.kept = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        if type(tensor) is not torch.Tensor or tensor.device.type == "cpu":
            self.kept += tensor.numel() * tensor.element_size()
            return tensor
        host = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu",
                                   pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        self.moved += tensor.numel() * tensor.element_size()
        return tensor.device, host

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def run_checkpointed(module: nn.Module, *args: Any, selective: bool = False, offload: Optional[HostOffload] = None,
                     **kwargs: Any) -> Any:
    """Run ``module`` under non-reentrant ``torch.utils.checkpoint``; the ``checkpoint_fn`` of the wrapper.

    The RNG state is preserved, so dropout draws the same masks when the block is recomputed.
    """
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    context_fn = _selective_contexts if selective else noop_context_fn
    with offload.hooks() if offload is not None else contextlib.nullcontext():
        return checkpoint(module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    """Forward pre-hook of a checkpoint wrapper: no key/value cache while training with gradients.

    A transformers block writes its keys and values into the cache it is given; the recompute in
    backward would write them a second time (and attend to both), so the block is run without one,
    as transformers' own gradient checkpointing does. Generation (no gradients) keeps its cache.
    """
    if not (module.training and torch.is_grad_enabled()):
        return None
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    return args, kwargs


def checkpoint_blocks(model: nn.Module, blocks: Sequence[nn.Module], mode: str = "full", every: Optional[int] = None,
                      offload: bool = False) -> list[nn.Module]:
    """Wrap the chosen ``blocks`` of ``model`` in place (``CheckpointWrapper``); returns the wrappers.

    The wrapper's state-dict hooks drop its ``_checkpoint_wrapped_module.`` part of the keys, so
    state dicts and checkpoints keep the model's own names.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    step = every if mode == "every_k" else 1
    chosen = [b for i, b in enumerate(blocks) if i % step == 0 and not isinstance(b, CheckpointWrapper)]
    host = HostOffload() if offload else None
    wrappers = []
    for block in chosen:
        wrapper = checkpoint_wrapper(block, checkpoint_fn=run_checkpointed, selective=mode == "selective",
                                     offload=host)
        wrapper.register_forward_pre_hook(_without_cache, with_kwargs=True)
        model.set_submodule(next(name for name, m in model.named_modules() if m is block), wrapper)
        wrappers.append(wrapper)
    return wrappers


def offload_of(model: nn.Module) -> Optional[HostOffload]:
    """The ``HostOffload`` the checkpoint wrappers in ``model`` share, if they offload."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for module in model.modules():
        if isinstance(module, CheckpointWrapper):
            host = module.checkpoint_fn.keywords.get("offload")
            if host is not None:
                return host
    return None


# -- measuring ----------------------------------------------------------------------------------
class SavedBytes:
    """Bytes of activation memory a forward leaves alive for backward, measured two ways.

    ``autograd``: distinct storages autograd saved (``saved_tensors_hooks``) that are not
    parameters, as they stand when the forward ends; ``alive``: every storage created during the
    forward and still alive at its end (what checkpointing keeps outside autograd's saved tensors,
    such as a selective checkpoint's kept outputs, included), the forward's outputs included.
    """

    def __init__(self) -> None:
        self.autograd = 0
        self.alive = 0


@contextlib.contextmanager
def measure_saved_bytes(model: nn.Module) -> Iterator[SavedBytes]:
    """Measure, around one forward of ``model``, what it keeps for backward (``SavedBytes``)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    def storage_of(tensor: torch.Tensor) -> Optional[torch.UntypedStorage]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this process's shard
        plain = type(local) in (torch.Tensor, nn.Parameter)
        return local.untyped_storage() if plain else None  # other subclasses hold no storage of their own

    params = {s.data_ptr() for s in map(storage_of, [*model.parameters(), *model.buffers()]) if s is not None}
    saved: dict[int, tuple[Any, int]] = {}
    created: dict[int, tuple[Any, int]] = {}

    def remember(into: dict, tensor: torch.Tensor) -> None:
        storage = storage_of(tensor)
        if storage is not None and storage.data_ptr() not in params and storage.nbytes():
            into[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        remember(saved, tensor)
        return tensor

    class Created(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    remember(created, t)
            return out

    result = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Created():
        yield result
    result.autograd = sum(n for ref, n in saved.values() if not ref.expired())
    result.alive = sum(n for ref, n in created.values() if not ref.expired())


__all__ = ["find_blocks", "checkpoint_blocks", "selective_policy", "saved_ops", "HostOffload", "run_checkpointed",
           "offload_of", "measure_saved_bytes", "SavedBytes"]
