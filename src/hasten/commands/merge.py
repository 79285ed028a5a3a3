"""``hasten merge-weights``: consolidated safetensors from a sharded checkpoint, without a process group.

CHECKPOINT may be a torch.distributed.checkpoint (DCP) folder (``.metadata`` + ``*.distcp``), a
folder holding such folders (Accelerate's ``pytorch_model_fsdp_0``), or a hasten checkpoint
(``manifest.json``), whose model entries are DCP folders (sharded strategies) or safetensors files
(single/DDP). Only the model weights are read (the optimizer state is never loaded), wrapper
prefixes (``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``)
are removed, and the result is written with ``hasten.saving.save_model``: atomic files,
transformers' names, shards plus an index above ``--max_shard_size``. Peak memory: one copy of
the model's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, NamedTuple

from .errors import HastenCLIError

DCP_METADATA = ".metadata"
MANIFEST = "manifest.json"  # hasten.checkpointing.layout.MANIFEST, repeated to keep --help light
# Top-level keys of a saved ``{"model": ..., "optimizer": ...}`` dict that hold no weights.
_OPTIMIZER_KEYS = ("optimizer", "optimizers", "optim", "optimizer_state", "optimizer_state_dict")
_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module")
_LEADING_WRAPPERS = ("module.", "_orig_mod.")
_INNER_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "merge-weights",
        help="Write consolidated safetensors weights from a sharded (DCP) or hasten checkpoint.",
        description="Read the model weights of CHECKPOINT (a torch.distributed.checkpoint folder, or a hasten "
                    "checkpoint folder) in this one process, without a process group, and write them to the "
                    "folder OUTPUT as model.safetensors (or shards and model.safetensors.index.json), loadable "
                    "with from_pretrained or load_checkpoint_in_model. Optimizer state is left out. Needs enough "
                    "memory for one copy of the weights.",
    )
    p.add_argument("checkpoint_directory", metavar="CHECKPOINT",
                   help="A DCP folder (with .metadata), a folder holding one, or a hasten checkpoint folder.")
    p.add_argument("output_path", metavar="OUTPUT",
                   help="Folder to write the weights into (created; must not hold weight files already). With "
                        "several models in a hasten checkpoint: OUTPUT/model_0, OUTPUT/model_1, ...")
    p.add_argument("--unsafe_serialization", "--unsafe-serialization", action="store_true",
                   help="Write pytorch_model.bin (pickle) instead of safetensors (not recommended).")
    p.add_argument("--remove_checkpoint_dir", "--remove-checkpoint-dir", action="store_true",
                   help="Delete CHECKPOINT after the weights are written.")
    p.add_argument("--max_shard_size", "--max-shard-size", default="10GB", metavar="SIZE",
                   help="Largest weight file before splitting into shards with an index (default: 10GB).")
    p.set_defaults(func=merge_command)


class Source(NamedTuple):
    """One model's weights inside a checkpoint: a DCP folder or a safetensors file."""

    kind: str  # "dcp" | "safetensors"
    path: str


def _is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))


def find_sources(checkpoint: str) -> tuple[list[Source], bool]:
    """The model sources of ``checkpoint`` and whether it is a hasten checkpoint; raises ``HastenCLIError``."""
    if not os.path.exists(checkpoint):
        raise HastenCLIError(f"CHECKPOINT {checkpoint!r} does not exist; pass the checkpoint folder")
    if not os.path.isdir(checkpoint):
        raise HastenCLIError(f"CHECKPOINT {checkpoint!r} is a file; pass the checkpoint folder")
    if os.path.isfile(os.path.join(checkpoint, MANIFEST)):
        return _hasten_sources(checkpoint), True
    if _is_dcp(checkpoint):
        return [Source("dcp", checkpoint)], False
    inner = sorted(name for name in os.listdir(checkpoint)
                   if _is_dcp(os.path.join(checkpoint, name)) and not name.startswith(_OPTIMIZER_KEYS))
    if inner:
        return [Source("dcp", os.path.join(checkpoint, name)) for name in inner], False
    raise HastenCLIError(f"CHECKPOINT {checkpoint!r} is not a checkpoint: it has no {DCP_METADATA} (a "
                         f"torch.distributed.checkpoint folder), no {MANIFEST} (a hasten checkpoint) and no "
                         "subfolder holding model weights in DCP format")


def _hasten_sources(folder: str) -> list[Source]:
    from ..checkpointing.layout import IncompleteCheckpointError, read_manifest

    try:
        manifest = read_manifest(folder)
    except (IncompleteCheckpointError, FileNotFoundError) as e:
        raise HastenCLIError(str(e).splitlines()[0]) from None
    entries = (manifest.get("contents") or {}).get("models") or []
    sources = []
    for i, entry in enumerate(entries):
        names = [entry.get(k) for k in ("file", "folder", "dcp", "path", "dir") if isinstance(entry, dict)]
        found = None
        for name in (n for n in names if isinstance(n, str)):
            full = os.path.join(folder, name)
            if _is_dcp(full):
                found = Source("dcp", full)
            elif os.path.isfile(full) and name.endswith(".safetensors"):
                found = Source("safetensors", full)
            if found:
                break
        if found is None:
            raise HastenCLIError(f"hasten checkpoint {folder!r}: model {i} ({json.dumps(entry)}) names no "
                                 "safetensors file or DCP folder this hasten can read; upgrade hasten")
        sources.append(found)
    if not sources:
        sources = [Source("dcp", os.path.join(folder, n)) for n in sorted(os.listdir(folder))
                   if _is_dcp(os.path.join(folder, n)) and not n.startswith(_OPTIMIZER_KEYS)]
    if not sources:
        raise HastenCLIError(f"hasten checkpoint {folder!r} holds no model weights (save_state was given no model)")
    return sources


def strip_wrappers(name: str) -> str:
    """A parameter name without the prefixes DDP, torch.compile, FSDP1 and activation checkpointing add."""
    for inner in _INNER_WRAPPERS:
        name = name.replace(inner, "")
    changed = True
    while changed:
        changed = False
        for prefix in _LEADING_WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def select_model_keys(metadata: Any) -> tuple[dict[str, str], list[str]]:
    """``({stored key: weight name}, skipped non-tensor keys)`` of a DCP checkpoint's model weights.

    DCP flattens a nested state dict; ``planner_data`` keeps each key's path. A ``{"model": ...}``
    entry (Accelerate, torchtitan, hasten) is taken alone; a single top-level key is unwrapped;
    optimizer entries are dropped in every case.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    planner = getattr(metadata, "planner_data", None) or {}
    paths = {k: tuple(planner.get(k, (k,))) for k in metadata.state_dict_metadata}
    tops = {p[0] for p in paths.values()}
    nested = all(len(p) > 1 for p in paths.values())
    keep_top = next((t for t in _MODEL_KEYS if t in tops and nested), None)
    if keep_top is None and nested and len(tops) == 1 and next(iter(tops)) not in _OPTIMIZER_KEYS:
        keep_top = next(iter(tops))
    raw_optimizer = {"state", "param_groups"} <= tops  # an optimizer.state_dict() saved on its own
    selected: dict[str, str] = {}
    skipped = []
    for key, path in paths.items():
        if keep_top is not None:
            if path[0] != keep_top:
                continue
            path = path[1:]
        elif path[0] in _OPTIMIZER_KEYS or (raw_optimizer and path[0] in ("state", "param_groups")):
            continue
        if not isinstance(metadata.state_dict_metadata[key], TensorStorageMetadata):
            skipped.append(key)
            continue
        selected[key] = ".".join(str(p) for p in path)
    return selected, skipped


def read_dcp(folder: str) -> tuple[dict[str, Any], list[str]]:
    """The model weights of a DCP folder as full CPU tensors, read in this process alone."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = dcp.FileSystemReader(folder)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged or foreign .metadata file
        raise HastenCLIError(f"cannot read the DCP metadata of {folder!r} ({type(e).__name__}: {e}); "
                             "the checkpoint is damaged or was written by another torch") from None
    selected, skipped = select_model_keys(metadata)
    if not selected:
        raise HastenCLIError(f"{folder!r} holds no model weights (only optimizer state or non-tensor values); "
                             "pass the model's checkpoint folder")
    buffers = {}
    for key in selected:
        meta = metadata.state_dict_metadata[key]
        buffers[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(buffers, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - missing or truncated .distcp files
            # DCP's exception (a BaseException) carries each rank's traceback: its last line is the cause.
            text = [line for line in str(e).strip().splitlines() if line.strip()]
            raise HastenCLIError(f"cannot read the weights in {folder!r}: {text[-1].strip() if text else type(e).__name__}"
                                 "; the checkpoint is incomplete or damaged") from None
    return {selected[k]: v for k, v in buffers.items()}, skipped


def read_safetensors(path: str) -> dict[str, Any]:
    """A hasten checkpoint's model file, with the tied names it stored once restored."""
    from safetensors import safe_open

    from ..saving import ALIASES_KEY

    tensors = {}
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    for alias, canonical in json.loads(metadata.get(ALIASES_KEY, "{}")).items():
        if canonical in tensors:
            tensors[alias] = tensors[canonical]  # the same tensor: save_model records the tie again
    return tensors


def _unwrapped(state: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in state.items():
        clean = strip_wrappers(name)
        if clean in out:
            raise HastenCLIError(f"{where}: {name!r} and another entry are both {clean!r} once wrapper prefixes "
                                 "are removed; the checkpoint mixes wrapped and plain names")
        out[clean] = value
    return out


def _check_output(output: str, checkpoint: str, remove: bool) -> None:
    from ..saving import _WEIGHT_FILE

    out_real, ck_real = os.path.realpath(output), os.path.realpath(checkpoint)
    if out_real == ck_real or out_real.startswith(ck_real + os.sep):
        raise HastenCLIError(f"OUTPUT {output!r} is inside CHECKPOINT {checkpoint!r}; pick a folder outside it")
    if ck_real.startswith(out_real + os.sep) and remove:
        raise HastenCLIError(f"OUTPUT {output!r} contains CHECKPOINT, which --remove_checkpoint_dir would delete; "
                             "pick another OUTPUT")
    if os.path.lexists(output) and not os.path.isdir(output):
        raise HastenCLIError(f"OUTPUT {output!r} exists and is a file; pass a folder path (it is created)")
    if os.path.isdir(output):
        present = sorted(n for n in os.listdir(output)
                         if _WEIGHT_FILE.fullmatch(n) or n.startswith("model_") and os.path.isdir(os.path.join(output, n)))
        if present:
            raise HastenCLIError(f"OUTPUT {output!r} already holds {', '.join(present[:3])}; pass a new folder or "
                                 "remove them first (merge-weights does not overwrite weights)")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise HastenCLIError(f"the folder {parent!r} that should hold OUTPUT does not exist; create it first")


def merge_weights(checkpoint: str, output: str, safe_serialization: bool = True, remove_checkpoint_dir: bool = False,
                  max_shard_size: Any = "10GB") -> list[tuple[str, int, int]]:
    """Write the model weights of ``checkpoint`` to ``output``; ``[(folder, tensors, bytes)]`` per model."""
    from ..saving import parse_size

    try:
        parse_size(max_shard_size)
    except (TypeError, ValueError) as e:
        raise HastenCLIError(str(e).replace("max_shard_size=", "--max_shard_size ")) from None
    sources, is_hasten = find_sources(checkpoint)
    _check_output(output, checkpoint, remove_checkpoint_dir)
    from ..saving import save_model

    written = []
    for i, source in enumerate(sources):
        target = output if len(sources) == 1 else os.path.join(output, f"model_{i}")
        if source.kind == "dcp":
            state, skipped = read_dcp(source.path)
            if skipped:
                print(f"hasten merge-weights: left out {len(skipped)} non-tensor entries of {source.path} "
                      f"({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''})", file=sys.stderr)
        else:
            state = read_safetensors(source.path)
        state = _unwrapped(state, source.path)
        os.makedirs(target, exist_ok=True)
        save_model(state, target, max_shard_size=max_shard_size, safe_serialization=safe_serialization,
                   is_main_process=True)
        unique = {id(v): v for v in state.values()}
        written.append((target, len(state), sum(v.numel() * v.element_size() for v in unique.values())))
        del state, unique
    if remove_checkpoint_dir:
        if is_hasten:
            from ..checkpointing.layout import remove_tree

            remove_tree(checkpoint)  # renamed first, so it never looks complete while half deleted
        else:
            shutil.rmtree(checkpoint)
    return written


def merge_command(args: argparse.Namespace) -> int:
    from .memory_model import human_bytes

    written = merge_weights(args.checkpoint_directory, args.output_path, not args.unsafe_serialization,
                            args.remove_checkpoint_dir, args.max_shard_size)
    for folder, count, nbytes in written:
        print(f"hasten merge-weights: wrote {count} tensors ({human_bytes(nbytes)}) to {folder}")
    if args.remove_checkpoint_dir:
        print(f"hasten merge-weights: removed {args.checkpoint_directory}")
    return 0
