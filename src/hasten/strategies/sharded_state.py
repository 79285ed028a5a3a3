"""State dicts of models whose parameters may be sharded (``DTensor``), through
``torch.distributed.checkpoint.state_dict``: one code path for plain, FSDP2 and tensor-parallel
models."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..activation_checkpointing import strip_checkpoint_prefix


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2 or tensor parallel)."""
    return any(hasattr(p, "to_local") and hasattr(p, "placements") for p in model.parameters())


def full_state_dict(model: nn.Module, everyone: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on CPU: on process 0, or on every process with ``everyone``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=not everyone)
    state = get_model_state_dict(model, options=options)
    if everyone:
        state = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return state


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
    """Load a full state dict (every process holds it) into a plain or sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not is_sharded(model):
        return model.load_state_dict(state_dict, strict=strict)
    return set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))


def optimizer_fqn_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``-style ``saved`` (parameters numbered) keyed by parameter names instead."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), strip_checkpoint_prefix(name))
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if any(n is None for n in order):
        raise ValueError(f"optimizer {type(optimizer).__name__} holds parameters of more than one model; a full "
                         "optimizer state cannot be converted to a sharded layout")
    state = {order[int(pid)]: value for pid, value in saved["state"].items()}
    groups = []
    for group in saved["param_groups"]:
        groups.append(dict(group, params=[order[int(pid)] for pid in group["params"]]))
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a full, numbered optimizer state (as single/DDP checkpoints hold it) into a sharded model's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optimizer_fqn_state(model, optimizer, saved),
                             options=StateDictOptions(full_state_dict=True))


def save_full_streamed(model: nn.Module, directory: str, max_shard_size: Any, is_main_process: bool) -> list[str]:
    """Write a sharded model's full weights as safetensors (sharded files + index when large),
    gathering one file's worth of tensors at a time: no process ever holds the whole model.

    Every process must call it (each tensor is all-gathered); only ``is_main_process`` writes.
    """
    import os
    import uuid

    from ..saving import (ALIASES_KEY, CHECKSUMS_KEY, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, SAVE_ID_KEY,
                          _index_text, atomic_paths, atomic_write, fsync_path, parse_size, write_weights_into)

    limit = parse_size(max_shard_size)
    state = model.state_dict()
    kept, aliases, first = {}, {}, {}
    for name, value in state.items():
        key = id(value)
        if key in first:
            aliases[name] = first[key]  # tied weights are stored once
            continue
        first[key] = name
        kept[name] = value
    groups: list[list[str]] = [[]]
    size = 0
    for name, value in kept.items():
        nbytes = value.numel() * value.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    count = len(groups)
    files = [SAFE_WEIGHTS_NAME] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    save_id = uuid.uuid4().hex
    # A failure of the writer (folder, disk) is kept, not raised: the other processes are in the
    # gathers below, which it must still join; at the end every process raises the same error.
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    failure: Optional[Exception] = None
    writes = is_main_process

    def attempt(step: Callable[[], Any]) -> Any:
        nonlocal failure, writes
        try:
            return step()
        except Exception as e:  # noqa: BLE001 - reported to every process below
            if not several:
                raise
            failure, writes = e, False
            return None

    if writes:
        attempt(lambda: os.makedirs(directory, exist_ok=True))
    # Every file goes to a temporary name and is renamed into place only once all are written and fsynced
    # (files.durable.atomic_paths): a write failing on the third file leaves an earlier save whole.
    files_at = atomic_paths([os.path.join(directory, f) for f in files], sync_folder=False)
    temporary = dict(zip(files, attempt(files_at.__enter__) or [])) if writes else {}
    weight_map, total, checksums = {}, 0, {}
    try:
        for filename, names in zip(files, groups):
            shard = {}
            for name in names:
                value = kept[name]
                full = value.full_tensor() if hasattr(value, "full_tensor") else value  # every process, always
                if writes:
                    shard[name] = full.detach().to("cpu").contiguous()
                    total += shard[name].nbytes
                del full
            if writes:
                checksums[filename] = attempt(lambda f=filename, s=shard: write_weights_into(
                    temporary[f], s, aliases, save_id if count > 1 else None))
            weight_map.update({n: filename for n in names})
            del shard
    except BaseException as e:  # one process: raised at once; every temporary file goes
        if temporary:
            files_at.__exit__(type(e), e, e.__traceback__)
        raise
    if temporary:
        if writes:  # all written: renamed into place
            attempt(lambda: (files_at.__exit__(None, None, None), fsync_path(directory)))
        else:  # one failed: every temporary file goes, the files of an earlier save stay
            files_at.__exit__(RuntimeError, RuntimeError("save_model failed"), None)
    if writes and count > 1:
        # The same index as save_model's: each file's checksum, and the index's own.
        index = {"metadata": {"total_size": total, SAVE_ID_KEY: save_id, CHECKSUMS_KEY: checksums,
                              **({ALIASES_KEY: aliases} if aliases else {})},
                 "weight_map": weight_map}

        def write_index() -> None:
            with atomic_write(os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME), "w") as f:
                f.write(_index_text(index))

        attempt(write_index)
    if several:
        from ..checkpointing.commit import agree

        problem = f"process {dist.get_rank()}: {type(failure).__name__}: {failure}" if failure else None
        agree(problem, f"save_model could not write the weights to {directory}:")
    return files
