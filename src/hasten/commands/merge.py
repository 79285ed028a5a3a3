"""``hasten merge-weights``: consolidated safetensors from a sharded checkpoint, without a process group.

CHECKPOINT may be a torch.distributed.checkpoint (DCP) folder (``.metadata`` + ``*.distcp``), a
folder holding such folders (Accelerate's ``pytorch_model_fsdp_0``), a DeepSpeed checkpoint (a
``save_checkpoint`` folder, or one tag of it: ZeRO 0-3, rebuilt with DeepSpeed's ``zero_to_fp32``
reading every partition weights-only), or a hasten checkpoint (``manifest.json``), whose model
entries are DCP folders (sharded strategies), engine checkpoints (DeepSpeed) or safetensors files
(single/DDP). Only the model weights are read (the optimizer state is never loaded), wrapper
prefixes (``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``)
are removed, and the result is written with ``hasten.saving.save_model``: atomic files,
transformers' names, shards plus an index above ``--max_shard_size``. Peak memory: one copy of
the model's weights (DeepSpeed: plus the fp32 partitions of every process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import re
from typing import Any, NamedTuple, Optional

from .errors import HastenCLIError

DCP_METADATA = ".metadata"
MANIFEST = "manifest.json"  # hasten.checkpointing.layout.MANIFEST, repeated to keep --help light
# Top-level keys of a saved ``{"model": ..., "optimizer": ...}`` dict that hold no weights.
_OPTIMIZER_KEYS = ("optimizer", "optimizers", "optim", "optimizer_state", "optimizer_state_dict")
_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module")
_NUMBERED_MODEL = re.compile(r"model_\d+")  # hasten's sharded checkpoints: model_0, model_1, ...
_LEADING_WRAPPERS = ("module.", "_orig_mod.")
_INNER_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "merge-weights",
        help="Write consolidated safetensors weights from a sharded (DCP, DeepSpeed ZeRO) or hasten checkpoint.",
        description="Read the model weights of CHECKPOINT (a torch.distributed.checkpoint folder, a DeepSpeed "
                    "checkpoint folder, or a hasten checkpoint folder) in this one process, without a process "
                    "group, and write them to the "
                    "folder OUTPUT as model.safetensors (or shards and model.safetensors.index.json), loadable "
                    "with from_pretrained or load_checkpoint_in_model. Optimizer state is left out. Needs enough "
                    "memory for one copy of the weights.",
    )
    _add_arguments(p)


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` argument parser (Accelerate's name): added to ``subparsers`` when given, else a
    parser of its own. ``merge_command(parser.parse_args([...]))`` then runs the merge."""
    if subparsers is not None:
        add_parser(subparsers)
        return subparsers.choices["merge-weights"]
    parser = argparse.ArgumentParser(prog="hasten merge-weights",
                                     description="Write consolidated safetensors weights from a sharded checkpoint.")
    _add_arguments(parser)
    return parser


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_directory", metavar="CHECKPOINT",
                   help="A DCP folder (with .metadata), a folder holding one, a DeepSpeed checkpoint folder (or one "
                        "tag of it), or a hasten checkpoint folder.")
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
    """One model's weights inside a checkpoint: a DCP folder (and the top-level key of that model in
    it, when it holds several objects) or a safetensors file."""

    kind: str  # "dcp" | "safetensors" | "deepspeed" (an engine checkpoint folder: one tag)
    path: str
    key: Optional[str] = None
    verified: Any = None  # a safetensors file's bytes, read once and verified (``files.reading.ReadFile``)
    records: Any = None  # a DCP folder's files as the manifest records them (name inside it -> size, checksum)


def _is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))


def _dcp_folders(folder: str) -> list[str]:
    """``folder`` when it is a DCP folder, else its DCP subfolders that do not hold an optimizer."""
    if _is_dcp(folder):
        return [folder]
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder))
            if _is_dcp(os.path.join(folder, n)) and not n.startswith(_OPTIMIZER_KEYS)]


def find_sources(checkpoint: str) -> tuple[list[Source], bool]:
    """The model sources of ``checkpoint`` and whether it is a hasten checkpoint; raises ``HastenCLIError``."""
    if not os.path.exists(checkpoint):
        raise HastenCLIError(f"CHECKPOINT {checkpoint!r} does not exist; pass the checkpoint folder")
    if not os.path.isdir(checkpoint):
        raise HastenCLIError(f"CHECKPOINT {checkpoint!r} is a file; pass the checkpoint folder")
    if os.path.isfile(os.path.join(checkpoint, MANIFEST)):
        return _hasten_sources(checkpoint), True
    folders = _dcp_folders(checkpoint)
    if folders:
        return [Source("dcp", f) for f in folders], False
    tag = _deepspeed_tag(checkpoint)
    if tag is not None:
        return [Source("deepspeed", tag)], False
    raise HastenCLIError(f"CHECKPOINT {checkpoint!r} is not a checkpoint: it has no {DCP_METADATA} (a "
                         f"torch.distributed.checkpoint folder), no {MANIFEST} (a hasten checkpoint), no DeepSpeed "
                         "model states (*model_states.pt) and no subfolder holding model weights in these formats")


_LATEST_BYTES = 4096


def _latest_tag(folder: str, latest: str) -> Optional[str]:
    """The tag DeepSpeed's ``latest`` file names (None without one), read as a plain file of ``folder``
    (``files.paths``: a link, a FIFO swapped in, a device or a folder is refused, never waited on) and
    of a tag's size at most."""
    from ..files.errors import UnsafeFileError
    from ..files.paths import open_inside

    try:
        fd = open_inside(folder, "latest", "DeepSpeed 'latest' file", nested=False)
    except FileNotFoundError:
        return None
    except UnsafeFileError as e:
        raise HastenCLIError(f"{e}; remove it or pass the tag folder itself") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(_LATEST_BYTES + 1)
    if len(data) > _LATEST_BYTES:
        raise HastenCLIError(f"{latest!r} has more than {_LATEST_BYTES} bytes, so it does not name a DeepSpeed "
                             "checkpoint (a tag); it is damaged: remove it or pass the tag folder itself")
    return data.decode("utf-8", "replace").strip()


def _deepspeed_tag(folder: str) -> Optional[str]:
    """The engine checkpoint in ``folder``: itself, the tag its ``latest`` file names, or its only tag."""
    from ..checkpointing.deepspeed_state import is_engine_checkpoint

    if is_engine_checkpoint(folder):
        return folder
    tags = [n for n in sorted(os.listdir(folder)) if is_engine_checkpoint(os.path.join(folder, n))]
    if not tags:
        return None
    latest = os.path.join(folder, "latest")
    tag = _latest_tag(folder, latest)
    if tag is not None:
        if tag not in tags:
            raise HastenCLIError(f"{latest!r} names the DeepSpeed checkpoint {tag!r}, which {folder!r} does not hold "
                                 f"(it holds {', '.join(tags)}); pass one of them")
        return os.path.join(folder, tag)
    if len(tags) > 1:
        raise HastenCLIError(f"{folder!r} holds several DeepSpeed checkpoints ({', '.join(tags)}) and no 'latest' "
                             "file; pass one of them")
    return os.path.join(folder, tags[0])


def _hasten_sources(folder: str) -> list[Source]:
    """Model entries of a hasten manifest: ``{"file": "model.safetensors"}`` (single/DDP),
    ``{"dcp": "model_0"}``, the model's top-level key in the checkpoint's DCP folder (sharded), or
    ``{"deepspeed": "model_0"}``, the tag of its engine checkpoint under ``deepspeed/``."""
    from ..checkpointing.layout import IncompleteCheckpointError, read_manifest

    try:
        manifest = read_manifest(folder)
    except (IncompleteCheckpointError, FileNotFoundError) as e:
        raise HastenCLIError(str(e).splitlines()[0]) from None
    verified = _verify_files(folder, manifest)
    entries = (manifest.get("contents") or {}).get("models") or []
    dcp_folders = _dcp_folders(folder)
    sources = []
    for i, entry in enumerate(entries):
        entry = entry if isinstance(entry, dict) else {}
        file, key, tag = entry.get("file"), entry.get("dcp"), entry.get("deepspeed")
        if isinstance(tag, str):
            sources.append(Source("deepspeed", os.path.join(folder, "deepspeed", tag)))
        elif isinstance(file, str) and file.endswith(".safetensors") and os.path.isfile(os.path.join(folder, file)):
            sources.append(Source("safetensors", os.path.join(folder, file), verified=verified.get(file)))
        elif isinstance(key, str) and _is_dcp(os.path.join(folder, key)):  # a folder per model
            path = os.path.join(folder, key)
            sources.append(Source("dcp", path, records=_records(folder, path, manifest)))
        elif isinstance(key, str) and len(dcp_folders) == 1:
            sources.append(Source("dcp", dcp_folders[0], key, records=_records(folder, dcp_folders[0], manifest)))
        else:
            raise HastenCLIError(f"hasten checkpoint {folder!r}: model {i} ({json.dumps(entry)}) names no "
                                 "safetensors file or DCP shards this hasten can read; upgrade hasten")
    if not sources:
        raise HastenCLIError(f"hasten checkpoint {folder!r} holds no model weights (save_state was given no model)")
    return sources


def _records(folder: str, dcp_folder: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's records of the files of ``dcp_folder``, by their names inside it: ``read_dcp`` checks
    the shard files against them in the one pass that reads them."""
    prefix = os.path.relpath(dcp_folder, folder).replace(os.sep, "/") + "/"
    return {name[len(prefix):]: info for name, info in manifest["files"].items()
            if isinstance(name, str) and name.startswith(prefix) and isinstance(info, dict)}


def _verify_files(folder: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Every file the manifest lists has its recorded size and checksum and is a plain file inside the
    folder (no symbolic link on the way), checked before anything is written: a flipped byte anywhere
    stops the merge. Returns the verified bytes of the model files (``.safetensors`` the manifest's
    models name), which are what the merge then reads."""
    from ..files.errors import CheckpointCorruptError
    from ..files.reading import read_inside

    models = {e.get("file") for e in (manifest.get("contents") or {}).get("models") or [] if isinstance(e, dict)}
    kept = {}
    for name, info in sorted(manifest["files"].items()):
        try:
            read = read_inside(folder, name, info.get("size"), info.get("checksum"))
        except (CheckpointCorruptError, OSError) as e:
            raise HastenCLIError(str(e).replace("manifest", f"{MANIFEST}")) from None
        if name in models:
            kept[name] = read
        else:
            read.close()
    return kept


def _expand(source: Source, metadata: Any) -> list[Source]:
    """One source per model when a DCP folder holds several (``model_0``, ``model_1``, ...)."""
    if source.kind != "dcp" or source.key is not None:
        return [source]
    paths = _paths(metadata)
    if not all(len(p) > 1 for p in paths.values()):
        return [source]
    tops = sorted({p[0] for p in paths.values() if isinstance(p[0], str) and _NUMBERED_MODEL.fullmatch(p[0])},
                  key=lambda t: int(t.rpartition("_")[2]))
    return [source._replace(key=t) for t in tops] if len(tops) > 1 else [source]


def _paths(metadata: Any) -> dict[str, tuple]:
    # DCP flattens a nested state dict; planner_data keeps each flat key's path.
    planner = getattr(metadata, "planner_data", None) or {}
    return {k: tuple(planner.get(k, (k,))) for k in metadata.state_dict_metadata}


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


def select_model_keys(metadata: Any, key: Optional[str] = None) -> tuple[dict[str, str], list[str]]:
    """``({stored key: weight name}, skipped non-tensor keys)`` of a DCP checkpoint's model weights.

    With ``key``, the entries under that top-level key. Otherwise a ``{"model": ...}`` (Accelerate,
    torchtitan) or ``{"model_0": ...}`` entry is taken alone, a single top-level key is unwrapped, and
    optimizer entries (``optimizer*``, or a bare ``optimizer.state_dict()``) are dropped.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = _paths(metadata)
    tops = {p[0] for p in paths.values()}
    nested = all(len(p) > 1 for p in paths.values())
    keep_top = key
    if keep_top is None and nested:
        keep_top = next((t for t in (*_MODEL_KEYS, "model_0") if t in tops), None)
        if keep_top is None and len(tops) == 1 and not str(next(iter(tops))).startswith(_OPTIMIZER_KEYS):
            keep_top = next(iter(tops))
    raw_optimizer = {"state", "param_groups"} <= tops  # an optimizer.state_dict() saved on its own
    selected: dict[str, str] = {}
    skipped = []
    for flat, path in paths.items():
        if keep_top is not None:
            if path[0] != keep_top:
                continue
            path = path[1:]
        elif str(path[0]).startswith(_OPTIMIZER_KEYS) or (raw_optimizer and path[0] in ("state", "param_groups")):
            continue
        if not isinstance(metadata.state_dict_metadata[flat], TensorStorageMetadata):
            skipped.append(flat)
            continue
        selected[flat] = ".".join(str(p) for p in path)
    return selected, skipped


def read_metadata(folder: str) -> Any:
    """DCP's metadata of ``folder``, read with hasten's allow-list (``pickle.load`` could run code)."""
    import pickle

    from ..checkpointing.dcp_reader import check_folder, validate
    from ..files.unpickling import dcp_metadata
    from ..files.errors import CheckpointCorruptError

    try:
        check_folder(folder)
        metadata = dcp_metadata(os.path.join(folder, DCP_METADATA))
        validate(folder, metadata)  # before read_dcp allocates what it claims
        return metadata
    except (pickle.UnpicklingError, CheckpointCorruptError) as e:  # refused, damaged or crafted (names the file)
        raise HastenCLIError(str(e).splitlines()[0]) from None
    except Exception as e:  # noqa: BLE001 - a damaged or foreign .metadata file
        raise HastenCLIError(f"cannot read the DCP metadata of {folder!r} ({type(e).__name__}: {e}); "
                             "the checkpoint is damaged or was written by another torch") from None


def plan_dcp(folder: str, metadata: Any, key: Optional[str] = None) -> tuple[dict[str, str], list[str]]:
    """``select_model_keys``, refusing a source without weights (checked before anything is written)."""
    selected, skipped = select_model_keys(metadata, key)
    if not selected:
        what = f"no entry {key!r}" if key else "no model weights (only optimizer state or non-tensor values)"
        raise HastenCLIError(f"{folder!r} holds {what}; pass the model's checkpoint folder")
    return selected, skipped


def read_dcp(folder: str, metadata: Any, selected: dict[str, str], records: Any = None) -> dict[str, Any]:
    """The ``selected`` weights of a DCP folder as full CPU tensors, read in this process alone, each shard
    file once through ``files.reading`` (checked against ``records``, the manifest's, when given)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..checkpointing.dcp_reader import MetadataReader, WeightsOnlyPlanner, records_opener, wrapped

    buffers = {}
    for key in selected:
        meta = metadata.state_dict_metadata[key]
        buffers[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            reader = MetadataReader(folder, metadata, records_opener(folder, records))
            dcp.load(buffers, storage_reader=reader, planner=WeightsOnlyPlanner(folder), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - missing or truncated .distcp files
            # DCP's exception (a BaseException) carries each rank's traceback: wrapped names the cause.
            raise HastenCLIError(str(wrapped(folder, e)).replace("cannot read the DCP shards", "cannot read the "
                                                                 "weights")) from None
    return {selected[k]: v for k, v in buffers.items()}


def read_safetensors(path: str, verified: Any = None) -> dict[str, Any]:
    """A hasten checkpoint's model file, with the tied names it stored once restored: from its
    ``verified`` bytes when the manifest's check read them, else read here once (a plain file)."""
    from ..files.errors import CheckpointCorruptError
    from ..files.reading import read_path
    from ..files.safetensors_format import SafetensorsView
    from ..saving import ALIASES_KEY

    try:
        view = SafetensorsView(verified if verified is not None else read_path(path, what="model file"))
        tensors = view.tensors()
        aliases = json.loads(view.metadata.get(ALIASES_KEY, "{}"))
    except (CheckpointCorruptError, OSError, ValueError) as e:
        raise HastenCLIError(f"cannot read {path!r} ({type(e).__name__}: {e}); the file is damaged") from None
    for alias, canonical in aliases.items():
        if canonical in tensors:
            tensors[alias] = tensors[canonical]  # the same tensor: save_model records the tie again
    return tensors


def read_deepspeed(path: str) -> dict[str, Any]:
    """The consolidated fp32 weights of one DeepSpeed engine checkpoint (every ZeRO partition read here)."""
    # Consolidating runs on the CPU: DeepSpeed need not probe for a device (and warn on stdout that it found none).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ..checkpointing.deepspeed_state import consolidated_weights

    try:
        return consolidated_weights(path)
    except ValueError as e:
        raise HastenCLIError(str(e)) from None


def _unwrapped(state: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in state.items():
        clean = strip_wrappers(name)
        if clean in out:
            raise HastenCLIError(f"{where}: {name!r} and another entry are both {clean!r} once wrapper prefixes "
                                 "are removed; the checkpoint mixes wrapped and plain names")
        out[clean] = value
    return out


def _check_output(output: str, checkpoint: str, remove: bool, overwrite: bool = False) -> None:
    from ..saving import _WEIGHT_FILE

    out_real, ck_real = os.path.realpath(output), os.path.realpath(checkpoint)
    if out_real == ck_real or out_real.startswith(ck_real + os.sep):
        raise HastenCLIError(f"OUTPUT {output!r} is inside CHECKPOINT {checkpoint!r}; pick a folder outside it")
    if ck_real.startswith(out_real + os.sep) and remove:
        raise HastenCLIError(f"OUTPUT {output!r} contains CHECKPOINT, which --remove_checkpoint_dir would delete; "
                             "pick another OUTPUT")
    if os.path.lexists(output) and not os.path.isdir(output):
        raise HastenCLIError(f"OUTPUT {output!r} exists and is a file; pass a folder path (it is created)")
    if os.path.isdir(output) and not overwrite:
        present = sorted(n for n in os.listdir(output)
                         if _WEIGHT_FILE.fullmatch(n) or n.startswith("model_") and os.path.isdir(os.path.join(output, n)))
        if present:
            raise HastenCLIError(f"OUTPUT {output!r} already holds {', '.join(present[:3])}; pass a new folder or "
                                 "remove them first (merge-weights does not overwrite weights)")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise HastenCLIError(f"the folder {parent!r} that should hold OUTPUT does not exist; create it first")


def merge_weights(checkpoint: str, output: str, safe_serialization: bool = True, remove_checkpoint_dir: bool = False,
                  max_shard_size: Any = "10GB", *, overwrite: bool = False) -> list[tuple[str, int, int]]:
    """Write the model weights of ``checkpoint`` to ``output``; ``[(folder, tensors, bytes)]`` per model.

    ``overwrite`` replaces weight files already in ``output`` (the CLI refuses them; ``merge_fsdp_weights``
    replaces them, as Accelerate's does)."""
    from ..saving import parse_size

    try:
        parse_size(max_shard_size)
    except (TypeError, ValueError) as e:
        raise HastenCLIError(str(e).replace("max_shard_size=", "--max_shard_size ")) from None
    sources, is_hasten = find_sources(checkpoint)
    _check_output(output, checkpoint, remove_checkpoint_dir, overwrite)
    metadata = {s.path: read_metadata(s.path) for s in sources if s.kind == "dcp"}
    sources = [part for s in sources for part in _expand(s, metadata.get(s.path))]
    plans = [plan_dcp(s.path, metadata[s.path], s.key) if s.kind == "dcp" else None for s in sources]
    from ..saving import save_model

    written = []
    for i, (source, plan) in enumerate(zip(sources, plans)):
        target = output if len(sources) == 1 else os.path.join(output, f"model_{i}")
        if plan is not None:
            selected, skipped = plan
            state = read_dcp(source.path, metadata[source.path], selected, source.records)
            if skipped:
                print(f"hasten merge-weights: left out {len(skipped)} non-tensor entries of {source.path} "
                      f"({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''})", file=sys.stderr)
        elif source.kind == "deepspeed":
            state = read_deepspeed(source.path)
        else:
            state = read_safetensors(source.path, source.verified)
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
