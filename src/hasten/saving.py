"""Writing weights and objects safely: atomic files, ``save``, ``save_model`` and loading back.

Every file goes to a temporary name in its own directory, is flushed and fsynced, then renamed over
the destination (and the directory fsynced), so a crash leaves the old file or the new one, never a
torn one. Weights use safetensors by default and transformers' file names, so a directory written
by ``save_model`` loads with ``from_pretrained`` and a ``save_pretrained`` directory loads here.

Torch, safetensors and the process state are imported inside the functions: ``atomic_write`` is
also meant for light callers (the CLI writing configs) that must not pay for importing torch.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import OrderedDict
from typing import IO, TYPE_CHECKING, Any, Mapping, NamedTuple, Optional, Union

from .files.durable import atomic_path, atomic_paths, atomic_write, fsync_fd, fsync_path, write_atomically  # noqa: F401 - public here
from .files.errors import CheckpointCorruptError  # noqa: F401 - raised by loaders importing it from here
from .files.weights import (  # noqa: F401 - save_model's file names and checksum fields, public here
    CHECKSUM_KEY,
    CHECKSUMS_KEY,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    UNSET_CHECKSUM,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    checksum_field,
    self_checksum,
)


if TYPE_CHECKING:  # pragma: no cover
    import torch

PathLike = Union[str, "os.PathLike[str]"]

# Metadata keys (safetensors header and index "metadata"): dropped tied names -> the kept name, and
# an id shared by the shards and the index of one save, to detect a mix left by an interrupted save.
ALIASES_KEY = "hasten_aliases"
SAVE_ID_KEY = "hasten_save_id"
# Files a save_model call owns in its directory; anything else there (configs, ...) is left alone.
_WEIGHT_FILE = re.compile(
    r"model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin"
    r"|model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json"
)
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_LIST_LIMIT = 20


# -- sizes ----------------------------------------------------------------------------------------
def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"10GB"``, ``"500MB"``, ``"1GiB"``, ``"200KB"``.

    KB/MB/GB/TB are powers of 1000 (as in transformers), KiB/MiB/GiB/TiB powers of 1024.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size={size!r} must be an int (bytes) or a string like '10GB' or '500MiB'")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.fullmatch(size)
        if not match:
            raise ValueError(
                f"max_shard_size={size!r} is not a size; write a number and a unit like '10GB', '500MB', "
                "'1GiB' or '200KB' (KB/MB/GB/TB = 1000^n bytes, KiB/MiB/GiB/TiB = 1024^n)"
            )
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be more than 0 bytes, e.g. '10GB'")
    return value


# -- preparing tensors ----------------------------------------------------------------------------
def _same_view(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset())


def find_aliases(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """``{name: earlier name}`` for every entry that is the very same tensor view as an earlier one.

    Tied weights (``lm_head.weight`` is ``embed.weight``) show up this way in ``state_dict()``.
    """
    import torch

    groups: dict[Any, list[str]] = {}
    aliases: dict[str, str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        if value.device.type == "meta":  # no storage: only the same object is the same tensor
            key: Any = ("id", id(value))
        else:
            key = (value.device, value.untyped_storage().data_ptr())
        group = groups.setdefault(key, [])
        twin = next((other for other in group if _same_view(state_dict[other], value)), None)
        if twin is None:
            group.append(name)
        else:
            aliases[name] = twin
    return aliases


def _prepare(state_dict: Mapping[str, Any], safe: bool, what: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Kept entries as compact contiguous CPU tensors (each with its own storage) and the aliases."""
    import torch

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{what} needs a dict of tensors (a state dict), got a {type(state_dict).__name__}")
    bad_keys = [k for k in state_dict if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"{what}: state dict keys must be strings, got {_listing(bad_keys)}")
    non_tensors = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if safe and non_tensors:
        raise TypeError(
            f"{what}: safetensors stores only tensors, but {_listing(non_tensors)} are not tensors; "
            "remove them or pass safe_serialization=False"
        )
    on_meta = [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.device.type == "meta"]
    if on_meta:
        raise ValueError(
            f"{what}: {_listing(on_meta)} are on the meta device (no data); load or materialise the "
            "weights (e.g. via the accelerator's get_state_dict) before saving"
        )
    aliases = find_aliases(state_dict)
    owners: dict[Any, int] = {}
    for name, value in state_dict.items():
        if name not in aliases and isinstance(value, torch.Tensor) and value.numel():
            key = (value.device, value.untyped_storage().data_ptr())
            owners[key] = owners.get(key, 0) + 1
    kept: dict[str, Any] = {}
    for name, value in state_dict.items():
        if name in aliases:
            continue
        if not isinstance(value, torch.Tensor):
            kept[name] = value
            continue
        tensor = value.detach().to("cpu").contiguous()
        shares = value.numel() and owners[(value.device, value.untyped_storage().data_ptr())] > 1
        if tensor.untyped_storage().nbytes() != tensor.nbytes or (
            shares and tensor.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
        ):
            # A view into a bigger or shared storage: safetensors refuses shared storage and
            # torch.save would write the whole storage, so give it its own compact copy.
            tensor = tensor.clone()
        kept[name] = tensor
    return kept, aliases


def _listing(names: list) -> str:
    shown = ", ".join(repr(n) for n in names[:_LIST_LIMIT])
    more = len(names) - _LIST_LIMIT
    return shown + (f" and {more} more" if more > 0 else "")


# -- save -----------------------------------------------------------------------------------------
def _writes_here(save_on_each_node: bool) -> bool:
    from .state import PartialState

    state = PartialState()
    return state.is_local_main_process if save_on_each_node else state.is_main_process


def save(obj: Any, f: Union[PathLike, IO[bytes]], save_on_each_node: bool = False,
         safe_serialization: bool = False) -> None:
    """Save ``obj`` to ``f`` once: on the main process, or on each node's main process.

    Uses ``torch.save``, or safetensors with ``safe_serialization`` (``obj`` must then be a dict of
    tensors without shared storage). A path is written atomically; a file object is written as is.
    No collective is involved, so it may be called on every process or on the main one only; call
    ``wait_for_everyone()`` before other processes read the file.
    """
    path: Optional[str] = None
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
    elif not hasattr(f, "write"):
        raise TypeError(f"save(f={f!r}) needs a file path or a binary file object opened for writing")
    if not _writes_here(save_on_each_node):
        return
    if safe_serialization:
        from safetensors.torch import save as safe_bytes
        from safetensors.torch import save_file

        tensors, aliases = _prepare(obj, safe=True, what="save(safe_serialization=True)")
        if aliases and not isinstance(obj, OrderedDict):
            pairs = [f"{a!r} is {c!r}" for a, c in aliases.items()]
            raise ValueError(
                f"save(safe_serialization=True): safetensors cannot store tensors that share memory ({_listing(pairs)}); "
                "pass a module's state_dict() (its ties are then stored once), use save_model, which records the "
                "ties, or clone one of each pair"
            )
        metadata = {"format": "pt"}
        if aliases:  # a state_dict(), as Accelerate: one name of each tie is kept (safetensors cannot share memory)
            from .accelerate_channels import log_warning

            # A WARNING record on Accelerate's logger (word replaced), with its words first, as Accelerate does.
            pairs = [f"{a!r} (same tensor as {c!r})" for a, c in aliases.items()]
            log_warning("hasten.utils.other",
                        f"Removed shared tensor {sorted(aliases)} while saving: save(safe_serialization=True) left "
                        f"out {_listing(pairs)}, which share memory with saved tensors; the ties are recorded in the "
                        f"file's metadata ({ALIASES_KEY!r}), which load_checkpoint_in_model uses to restore them")
            metadata[ALIASES_KEY] = json.dumps(dict(aliases), sort_keys=True)
        if path is None:
            f.write(safe_bytes(tensors, metadata=metadata))  # type: ignore[union-attr]
        else:
            write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        return
    import torch

    if path is None:
        torch.save(obj, f)
    else:
        write_atomically(path, lambda tmp: torch.save(obj, tmp))


# -- save_model -----------------------------------------------------------------------------------
def save_model(state_dict: Mapping[str, Any], save_directory: PathLike, max_shard_size: Union[int, str] = "10GB",
               safe_serialization: bool = True, is_main_process: Optional[bool] = None) -> None:
    """Write a state dict to ``save_directory`` with transformers' file names.

    ``model.safetensors`` (``pytorch_model.bin`` when not ``safe_serialization``), or when larger than
    ``max_shard_size`` the shards ``model-00001-of-0000N.safetensors`` ... plus
    ``model.safetensors.index.json``. Tied names (the same tensor under two keys) are stored once;
    with safetensors the dropped names are recorded under ``"hasten_aliases"`` in the file and index
    metadata so that ``load_checkpoint_in_model`` restores them (``from_pretrained`` re-ties them
    itself). Every file is written and fsynced under a temporary name and the shards are renamed into
    place only once all are written, the index last, so a save that fails (full disk, I/O error) leaves
    an earlier save in the directory whole and loadable; weight files of an earlier save in
    the directory that this save does not use are removed afterwards. Only the main process writes
    (``is_main_process``, default: ``PartialState().is_main_process``); no collective is involved.
    """
    limit = parse_size(max_shard_size)
    directory = os.fspath(save_directory)
    if os.path.isfile(directory):
        raise NotADirectoryError(
            f"save_directory={directory!r} is an existing file; pass a directory path (it is created if missing)"
        )
    if is_main_process is None:
        is_main_process = _writes_here(False)
    if not is_main_process:
        return
    safe = bool(safe_serialization)
    kept, aliases = _prepare(state_dict, safe=safe, what="save_model")
    os.makedirs(directory, exist_ok=True)

    # Greedy shards in state-dict order; a tensor bigger than the limit gets a shard of its own.
    shard_of: dict[str, int] = {}
    sizes = [0]
    for name, value in kept.items():
        nbytes = getattr(value, "nbytes", 0)
        if sizes[-1] and sizes[-1] + nbytes > limit:
            sizes.append(0)
        sizes[-1] += nbytes
        shard_of[name] = len(sizes) - 1
    count = len(sizes)
    stem, ext = ("model", ".safetensors") if safe else ("pytorch_model", ".bin")
    files = [stem + ext] if count == 1 else [f"{stem}-{i:05d}-of-{count:05d}{ext}" for i in range(1, count + 1)]
    save_id = uuid.uuid4().hex

    checksums: dict[str, str] = {}
    # All shards are written and fsynced under temporary names before any replaces a file of an earlier
    # save: a save failing on its third shard (a full disk, an fsync error) leaves the earlier one whole.
    with atomic_paths([os.path.join(directory, f) for f in files], sync_folder=False) as temporary:
        for index, (filename, tmp) in enumerate(zip(files, temporary)):
            names = [n for n in state_dict if shard_of.get(n, shard_of.get(aliases.get(n, ""), -1)) == index]
            if safe:
                checksums[filename] = write_weights_into(tmp, {n: kept[n] for n in names if n in kept}, aliases,
                                                         save_id if count > 1 else None)
            else:
                import torch

                # torch.save keeps one copy of a storage used under several names, so ties stay as keys.
                torch.save({n: kept[aliases.get(n, n)] for n in names}, tmp)
    fsync_path(directory)

    keep = set(files)
    if count > 1:
        weight_map = {n: files[shard_of[aliases.get(n, n)]] for n in state_dict if not safe or n in kept}
        index_meta: dict[str, Any] = {"total_size": sum(getattr(v, "nbytes", 0) for v in kept.values())}
        if safe:
            index_meta[SAVE_ID_KEY] = save_id
            index_meta[CHECKSUMS_KEY] = checksums
            if aliases:
                index_meta[ALIASES_KEY] = dict(aliases)
        index_name = SAFE_WEIGHTS_INDEX_NAME if safe else WEIGHTS_INDEX_NAME
        index = {"metadata": index_meta, "weight_map": weight_map}
        with atomic_write(os.path.join(directory, index_name), "w") as f:
            f.write(_index_text(index) if safe else json.dumps(index, indent=2, sort_keys=True) + "\n")
        keep.add(index_name)
    _remove_stale(directory, keep)


def write_weights_file(target: str, shard: dict[str, Any], aliases: dict[str, str], save_id: Optional[str]) -> str:
    """One safetensors weights file, atomically, with the ties, the save id and its own checksum in
    its metadata (and, when its dtypes are hasten's writer's, the checksums of its header and of every
    ``files.ranged.BLOCK_SIZE`` bytes of its data); returns the whole file's checksum (for the index)."""
    digest: list[str] = []
    write_atomically(target, lambda tmp: digest.append(write_weights_into(tmp, shard, aliases, save_id)))
    return digest[0]


def write_weights_into(tmp: str, shard: dict[str, Any], aliases: dict[str, str], save_id: Optional[str]) -> str:
    """``write_weights_file``'s content written to the new file ``tmp`` (the caller renames it into place)."""
    from .files import ranged
    from .files.safetensors_format import DTYPES, write_safetensors

    metadata = {"format": "pt", CHECKSUM_KEY: UNSET_CHECKSUM}
    mine = {a: c for a, c in aliases.items() if c in shard}
    if mine:
        metadata[ALIASES_KEY] = json.dumps(mine, sort_keys=True)
    if save_id is not None:
        metadata[SAVE_ID_KEY] = save_id
    digest: list[str] = []

    def write(tmp: str) -> None:
        if all(t.dtype in DTYPES for t in shard.values()):  # summed while written, in blocks too (files.ranged)
            digest.append(write_safetensors(tmp, shard, metadata, block_size=ranged.BLOCK_SIZE)[1])
        else:  # a dtype only the safetensors library writes: summed from the file (read whole when loaded)
            from safetensors.torch import save_file

            from .files.reading import file_checksum

            save_file(shard, tmp, metadata=metadata)
            digest.append(file_checksum(tmp))
        with open(tmp, "r+b") as f:
            head = f.read(8)
            head += f.read(int.from_bytes(head, "little"))
            position = checksum_field(head, tmp)
            if position is None:  # cannot happen: the field was written just above
                raise RuntimeError(f"{tmp!r}: the checksum field of the header was not written")
            f.seek(position[0])
            f.write(digest[0].encode("ascii"))

    write(tmp)
    return digest[0]


def _index_text(index: dict[str, Any]) -> str:
    """The JSON of a ``save_model`` index, with the checksum of its own bytes in its metadata."""
    from .files.checksum import BlockSummer

    index["metadata"][CHECKSUM_KEY] = UNSET_CHECKSUM
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    summer = BlockSummer()
    summer.update(text.encode("utf-8"))
    field = f'"{CHECKSUM_KEY}": "{UNSET_CHECKSUM}"'
    if text.count(field) != 1:  # a tensor name spelling the field itself: keep the index unambiguous
        raise ValueError(f"save_model: a tensor name in the index reads like {field}; rename it")
    return text.replace(field, f'"{CHECKSUM_KEY}": "{summer.digest()}"')


def _remove_stale(directory: str, keep: set[str]) -> None:
    """Remove weight files (our naming pattern only) left by an earlier save, once the new ones exist.

    Both formats go: a loader prefers ``model.safetensors`` to ``pytorch_model.bin``, so a stale file
    of the other format would shadow this save.
    """
    removed = False
    for filename in os.listdir(directory):
        full = os.path.join(directory, filename)
        if filename not in keep and _WEIGHT_FILE.fullmatch(filename) and os.path.isfile(full):
            try:
                os.remove(full)
                removed = True
            except FileNotFoundError:
                pass
    if removed:
        fsync_path(directory)


# -- loading --------------------------------------------------------------------------------------
class CheckpointMismatchError(RuntimeError):
    """The checkpoint does not fit the model (missing or unexpected keys, other shapes)."""


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]
