"""Fill a prepared (FSDP2, tensor-parallel, HSDP, dp_shard x tp, expert-parallel) model from a
checkpoint folder, each process copying only the slices of the tensors it holds.

Used by ``hasten.load_checkpoint_in_model`` when the model has ``DTensor`` parameters. The model
may still be on ``meta`` (built under ``init_empty_weights()`` on every process and prepared):
its shards are then allocated here (``to_empty``, which FSDP2 follows) and read from the files.
Each process takes the block of each tensor it holds (``held_block``: its FSDP2 rows, its TP
columns, its experts' rows under expert parallelism) from the file itself: of a safetensors file it
reads the header and then only the bytes of its blocks (``files.ranged``: for each block, the smallest
contiguous byte range covering it, widened to whole checksummed blocks and each verified where
``save_model`` recorded block checksums), never the rest; a file recording only a checksum of its
whole bytes (an older hasten) and a ``.bin`` are still read whole, one file in memory at a time. Host
memory holds this process's shards plus its own parts of one file (or one whole file) at most.

Every process checks the whole checkpoint against the whole model (names, shapes) before any
shard changes, and every process raises when any process fails (one all-gather), so no process
is left waiting in a later collective.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from ..weights_sources import checkpoint_sources, fit_problems, log_partial_load
from ..saving import CheckpointMismatchError, LoadResult, _listing
from ..activation_checkpointing import strip_checkpoint_prefix
from .dtensor import _move_buffers


class _Slot(NamedTuple):
    """One parameter or buffer of the model, under its checkpoint name."""

    module: nn.Module
    attr: str
    tensor: torch.Tensor
    is_param: bool
    persistent: bool


def is_sharded_model(model: nn.Module) -> bool:
    """Whether ``model`` holds ``DTensor`` parameters (prepared under FSDP2 or tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _slots(model: nn.Module) -> dict[str, _Slot]:
    """Every parameter and buffer by name (tied ones under each of their names)."""
    out: dict[str, _Slot] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = strip_checkpoint_prefix(module_name + ".") if module_name else ""
        for attr, param in module._parameters.items():
            if param is not None:
                out[prefix + attr] = _Slot(module, attr, param, True, True)
        for attr, buffer in module._buffers.items():
            if buffer is not None:
                persistent = attr not in module._non_persistent_buffers_set
                out[prefix + attr] = _Slot(module, attr, buffer, False, persistent)
    return out


def _tie_groups(slots: dict[str, _Slot]) -> dict[str, list[str]]:
    """``{first name: every name}`` of each tensor that several names share (tied weights)."""
    first: dict[int, str] = {}  # id of a tensor the slots hold alive -> its first name
    groups: dict[str, list[str]] = {}
    for name, slot in slots.items():
        owner = first.setdefault(id(slot.tensor), name)
        groups.setdefault(owner, []).append(name)
    return groups


class _Plan(NamedTuple):
    sources: list  # weights_sources.Source, one per file
    where: dict[str, tuple[Any, str]]  # first name of each tensor to read -> (source, key in the file)
    missing: list[str]
    unexpected: list[str]


def _plan(model: nn.Module, checkpoint: Any, strict: bool) -> _Plan:
    """Match the checkpoint's tensors to the model's, or raise ``CheckpointMismatchError`` naming
    every problem (key, shapes, file). The same on every process: all read the same headers."""
    sources, aliases = checkpoint_sources(checkpoint, release=True, ranged=True)  # headers only: slices read later
    found: dict[str, tuple[Any, str]] = {}
    for source in sources:
        for key in source.shapes:
            found.setdefault(key, (source, key))
    for alias, canonical in aliases.items():  # tied names a hasten save stored once
        if canonical in found and alias not in found:
            found[alias] = found[canonical]
    slots = _slots(model)
    where: dict[str, tuple[Any, str]] = {}
    missing, mismatched, unreadable = [], [], []
    for owner, names in _tie_groups(slots).items():
        slot = slots[owner]
        hit = next((found[n] for n in names if n in found), None)
        if hit is None:
            if slot.persistent:
                missing.append(owner)
            if slot.tensor.is_meta:
                unreadable.append(owner)
            continue
        source, key = hit
        shape = source.shapes[key]
        if shape is None or tuple(shape) != tuple(slot.tensor.shape):
            mismatched.append(f"{key}: checkpoint {list(shape) if shape is not None else 'not a tensor'} in "
                              f"{os.path.basename(source.path)!r} vs model {list(slot.tensor.shape)}")
        where[owner] = hit
    unexpected = sorted(k for k in found if k not in slots)
    problems = fit_problems(mismatched, missing, unexpected, strict)
    absent = [n for n in unreadable if not (strict and n in missing)]
    if absent:
        problems.append(f"missing from the checkpoint and still on the meta device (no value to give them): "
                        f"{_listing(absent)}")
    if problems:
        for source in sources:
            source.release()
        files = ", ".join(sorted({os.path.basename(s.path) for s in sources}))
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(checkpoint)!r} ({files}) does not fit {type(model).__name__} (model unchanged): "
            + "; ".join(problems)
            + ("; a non-persistent buffer is never in a checkpoint: build the model under init_empty_weights() "
               "without include_buffers=True so that buffers keep the values the model gives them" if absent else "")
        )
    return _Plan(sources, where, missing, unexpected)


def _agree(failure: Optional[BaseException]) -> None:
    """Raise on every process when any process failed: its own error where it failed, else one
    naming the processes that failed (a collective every process reaches)."""
    import torch.distributed as dist

    from ..checkpointing.collectives import gather

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not several:
        if failure is not None:
            raise failure
        return
    message = f"{type(failure).__name__}: {failure}" if failure is not None else None
    reports = gather(message)
    if failure is not None:
        raise failure
    others = [f"process {rank}: {m}" for rank, m in enumerate(reports) if m]
    if others:
        raise RuntimeError("load_checkpoint_in_model failed on other processes (this one's shards may be "
                           "partly filled): " + "; ".join(others))


def _offloaded(model: nn.Module) -> bool:
    """Whether FSDP2 keeps this model's shards in host memory (``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None and isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
                return True
    return False


def _device(model: nn.Module) -> torch.device:
    """Where the model's shards live: its mesh's device (this process's accelerator, or CPU)."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            kind = param.device_mesh.device_type
            if kind == "cpu":
                return torch.device("cpu")
            return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _materialise(model: nn.Module) -> None:
    """Give the model's ``meta`` tensors storage (uninitialised) on their device, keeping the values
    of the tensors that have one (e.g. non-persistent buffers computed when the model was built)."""
    slots = _slots(model)
    if not any(s.tensor.is_meta for s in slots.values()):
        return
    kept = {name: _local(s.tensor).detach().clone() for name, s in slots.items() if not s.tensor.is_meta}
    device = _device(model)
    offload = _offloaded(model)
    model.to_empty(device=torch.device("cpu") if offload else device)
    if offload:  # FSDP2 holds offloaded shards in host memory, and everything else on the device
        _move_buffers(model, device)
    after = _slots(model)
    with torch.no_grad():
        for name, value in kept.items():
            _local(after[name].tensor).copy_(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held_block(tensor: torch.Tensor) -> tuple:
    """The part of the whole tensor that this process holds of ``tensor``, as slices: what it takes from
    a checkpoint's tensor (e.g. its experts' rows under expert parallelism)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(shape) != tuple(local.shape):  # a layout whose shard is not one block of the tensor
        raise NotImplementedError(f"load_checkpoint_in_model: a parameter of shape {list(tensor.shape)} laid out as "
                                  f"{tensor.placements} holds {list(local.shape)} here, not one block; load it with "
                                  "accelerator.load_state or before preparing")
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _read_blocks(source: Any, wanted: list[tuple[str, tuple, torch.Tensor]]) -> None:
    """Copy the block ``index`` of tensor ``key`` of ``source`` into ``dest`` (its dtype wins) for each
    ``(key, index, dest)`` of ``wanted``: read together from the file, only those bytes where it can be
    (``weights_sources.Source.blocks``), verified."""
    wanted = [w for w in wanted if w[2].numel()]
    for (_, _, dest), block in zip(wanted, source.blocks([(key, index) for key, index, _ in wanted])):
        dest.copy_(block)


def load_into_sharded(model: nn.Module, checkpoint: Any, strict: bool) -> Any:
    """Fill ``model`` (DTensor parameters, possibly on ``meta``) from ``checkpoint``; see the module's
    docstring. Every process must call it. Returns ``LoadResult(missing, unexpected)``."""
    plan: Optional[_Plan] = None
    failure: Optional[BaseException] = None
    try:
        plan = _plan(model, checkpoint, strict)
    except Exception as e:  # noqa: BLE001 - raised on every process by _agree
        failure = e
    _agree(failure)
    assert plan is not None
    try:
        _materialise(model)
        slots = _slots(model)
        with torch.no_grad():
            for source in plan.sources:  # one file's parts (or bytes) in memory at a time
                wanted = [(key, held_block(slots[name].tensor), _local(slots[name].tensor))
                          for name, (owner, key) in plan.where.items() if owner is source]
                _read_blocks(source, wanted)
                source.release()
    except Exception as e:  # noqa: BLE001 - raised on every process by _agree
        failure = e
    finally:
        for source in plan.sources:
            source.release()
    _agree(failure)
    log_partial_load(checkpoint, model, plan.missing, plan.unexpected)
    return LoadResult(plan.missing, plan.unexpected)
