"""The disk-offload folder: weights on disk with an ``index.json``, read back lazily one tensor at a time.

Two layouts share the folder and the index. hasten's own offloading (the loaders, ``disk_offload``,
``dispatch_model``) writes ``offload-NNNNN.safetensors`` files, the index mapping each tensor name to
``{"safetensors_file", "weight_name", "dtype", "shape", "checksum"}`` (file names relative to the
folder, so it can be moved; tied names point at one stored tensor): a few checked files instead of
one per tensor. Accelerate's public functions for the folder keep Accelerate's layout, one raw
``<name>.dat`` array per tensor with ``{"dtype", "shape"}`` in the index: ``offload_state_dict``,
``offload_weight`` / ``save_offload_index`` and ``load_offloaded_weight`` write and read it as
Accelerate does, and the index in the file also records each ``.dat``'s checksum (Accelerate ignores
the key; hasten verifies it on reading). hasten reads both layouts, including folders Accelerate
wrote (through ``numpy.memmap``); Accelerate reads the ``.dat`` one. Nothing here unpickles. Every
file is written atomically; the index is rewritten (atomically) after the weights it names.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Union

from ..files.durable import atomic_paths, atomic_write, write_atomically
from ..files.errors import CheckpointCorruptError
from ..files.paths import open_inside, split, why_outside
from ..saving import _prepare

if TYPE_CHECKING:  # pragma: no cover
    import torch

PathLike = Union[str, "os.PathLike[str]"]
INDEX_NAME = "index.json"
_FILE_PATTERN = "offload-{:05d}.safetensors"
_OUR_FILE = re.compile(r"offload-\d{5,}\.safetensors")


def _corrupt(message: str) -> Exception:
    return CheckpointCorruptError(message)


def _open(path: str) -> int:
    """A descriptor of the offload file ``path``: a plain file, never through a link (``files.paths``)."""
    try:
        return open_inside(*split(path), "offload file", nested=False)
    except FileNotFoundError:
        raise _corrupt(f"the offload file {path!r} is missing; write the offload folder again") from None


def _file_in(folder: str, file: Any, name: str) -> str:
    """The path of an index entry's ``safetensors_file``: a plain file name inside ``folder``."""
    if (not isinstance(file, str) or not file or file in (".", "..") or "/" in file or "\\" in file or "\0" in file
            or os.path.isabs(file)):
        raise _corrupt(f"the offload index of {folder!r} puts {name!r} in {file!r}, which is not a file name inside the "
                       "folder; hasten writes only such names, so the index is damaged or crafted (nothing was read)")
    return os.path.join(folder, file)


def read_index(folder: PathLike) -> dict[str, dict[str, Any]]:
    """The folder's ``index.json`` (``{}`` when absent)."""
    path = os.path.join(os.fspath(folder), INDEX_NAME)
    if not os.path.lexists(path):
        return {}
    try:
        with os.fdopen(_open(path), "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, absurd nesting
        raise _corrupt(f"the offload index {path!r} is not readable JSON ({type(e).__name__}: {e}); it is damaged: "
                       "write the offload folder again") from None
    if not isinstance(index, dict) or not all(isinstance(e, dict) for e in index.values()):
        raise _corrupt(f"{path!r} is not an offload index (a JSON object of tensor name -> entry); it is damaged")
    return index


def _write_index(folder: str, index: Mapping[str, Any]) -> None:
    with atomic_write(os.path.join(folder, INDEX_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(dict(index), indent=1, sort_keys=True) + "\n")


def _next_file_name(folder: str) -> str:
    number = 1
    while os.path.exists(os.path.join(folder, _FILE_PATTERN.format(number))):
        number += 1
    return _FILE_PATTERN.format(number)


def write_offload_file(folder: PathLike, tensors: Mapping[str, "torch.Tensor"]) -> dict[str, dict[str, Any]]:
    """Write ``tensors`` to a new safetensors file in ``folder``; their index entries (not yet in the index).

    Names that are the same tensor are stored once and share the entry's ``weight_name``.
    """
    from safetensors.torch import save_file

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    if not tensors:
        return {}
    kept, aliases = _prepare(tensors, safe=True, what="disk offload")
    filename = _next_file_name(folder)
    write_atomically(os.path.join(folder, filename), lambda tmp: save_file(kept, tmp, metadata={"format": "pt"}))
    entries = {}
    for name, value in tensors.items():
        stored = aliases.get(name, name)
        entries[name] = {"safetensors_file": filename, "weight_name": stored,
                         "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape),
                         "checksum": _checksum(kept[stored])}
    return entries


def _checksum(tensor: "torch.Tensor") -> str:
    """bsum64 of a contiguous CPU tensor's bytes: what reading the entry back verifies."""
    from ..files.checksum import as_bytes_tensor, checksum_buffer

    return checksum_buffer(as_bytes_tensor(tensor.contiguous()))


def _check_sum(tensor: "torch.Tensor", entry: Mapping[str, Any], path: str, name: str) -> None:
    recorded = entry.get("checksum")
    if recorded is None:  # written by Accelerate or an older hasten: nothing to compare with
        return
    found = _checksum(tensor)
    if found != recorded:
        raise _corrupt(f"the offloaded weight {name!r} in {path!r} is corrupted: its bytes have checksum {found}, the "
                       f"index records {recorded} (a flipped bit or an edited file); write the offload folder again")


def add_to_index(folder: PathLike, entries: Mapping[str, Mapping[str, Any]]) -> None:
    """Merge ``entries`` into the folder's ``index.json`` (written atomically), then delete offload files
    that no entry names any more (left by an earlier offload of the same tensors), so that loading
    into one folder again and again does not fill the disk."""
    if not entries:
        return
    folder = os.fspath(folder)
    index = read_index(folder)
    index.update(entries)
    _write_index(folder, index)
    used = {entry.get("safetensors_file") for entry in index.values() if isinstance(entry, Mapping)}
    for name in os.listdir(folder):
        if _OUR_FILE.fullmatch(name) and name not in used:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))


def offload_state_dict(save_dir: PathLike, state_dict: Mapping[str, "torch.Tensor"]) -> None:
    """Write ``state_dict`` to the offload folder ``save_dir`` in Accelerate's format (one ``<name>.dat``
    per tensor, each written atomically) and add the tensors to its ``index.json``, with the checksum of
    each file that reading verifies. Accelerate reads the folder too. hasten's own offloading (the
    loaders, ``disk_offload``, ``dispatch_model``) writes safetensors files: ``offload_to_safetensors``."""
    folder = os.fspath(save_dir)
    os.makedirs(folder, exist_ok=True)
    paths = [_inside(folder, name, "offload_weight: weight_name") for name in state_dict]
    entries = {}
    # Every file written and fsynced before any replaces one the index records: a failure part-way (full
    # disk, fsync error) leaves the folder as it was, each file matching its recorded checksum.
    with atomic_paths(paths) as temporary:
        for tmp, (name, tensor) in zip(temporary, state_dict.items()):
            _, array, entries[name] = _dat(tensor, name, folder)  # one tensor's CPU copy at a time
            with open(tmp, "wb") as f:
                f.write(array.tobytes())
            del array
    add_to_index(folder, entries)


def offload_to_safetensors(save_dir: PathLike, state_dict: Mapping[str, "torch.Tensor"]) -> None:
    """Write ``state_dict`` to a new safetensors file in ``save_dir`` (tied names stored once) and add
    its tensors to the index."""
    add_to_index(save_dir, write_offload_file(save_dir, state_dict))


def _inside(folder: str, name: str, what: str) -> str:
    """The path of ``<name>.dat`` in ``folder``, refusing names that leave it (``contained.why_outside``)."""
    why = why_outside(folder, name, suffix=".dat")
    if why:
        raise ValueError(f"{what} {name!r} names a file outside the offload folder {folder!r} ({why}); only "
                         "plain names of real files inside it are read or written (copy a linked file in instead)")
    return os.path.join(folder, f"{name}.dat")


def _read_raw_array(folder: str, name: str, entry: Mapping[str, Any]) -> "torch.Tensor":
    """A tensor from Accelerate's ``<name>.dat`` format (a raw array; dtype and shape in the index)."""
    try:
        path = _inside(folder, name, "offload index entry")
    except ValueError as e:
        raise _corrupt(f"{e}; the index {os.path.join(folder, INDEX_NAME)!r} is damaged or crafted") from None
    tensor = load_offloaded_weight(path, entry)
    _check_sum(tensor, entry, path, name)
    return tensor


def _dtype_and_shape(entry: Mapping[str, Any], path: str, name: str) -> tuple["torch.dtype", tuple]:
    import torch

    dtype = getattr(torch, str(entry.get("dtype")), None)
    shape = entry.get("shape")
    if (not isinstance(dtype, torch.dtype) or not isinstance(shape, (list, tuple))
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)):
        raise _corrupt(f"the offload index entry of {name!r} (file {path!r}) has a damaged dtype {entry.get('dtype')!r} "
                       f"or shape {shape!r}; write the offload folder again")
    return dtype, tuple(shape)


def _numpy_stand_in(dtype_name: str) -> str:
    # numpy has no bfloat16 / float8: Accelerate's format stores them as integers of the same width
    return "int16" if dtype_name == "bfloat16" else "int8" if dtype_name.startswith("float8") else dtype_name


def load_offloaded_weight(weight_file: PathLike, weight_info: Mapping[str, Any]) -> "torch.Tensor":
    """Read one ``.dat`` file of Accelerate's offload format into a CPU tensor (a copy, not a map).

    weight_info: its index entry, ``{"dtype": "float16", "shape": [4, 8]}``.
    """
    import numpy as np
    import torch

    path = os.fspath(weight_file)
    dtype, shape = _dtype_and_shape(weight_info, path, os.path.basename(path))
    dtype_name = str(dtype).replace("torch.", "")
    stored = _numpy_stand_in(dtype_name)
    from ..files.reading import pread_tensor

    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        expected = math.prod(shape or (1,)) * torch.empty((), dtype=dtype).element_size()
        if size != expected:
            raise _corrupt(f"the offload file {path!r} has {size} bytes, but its index entry ({dtype_name}, shape "
                           f"{list(shape)}) needs {expected}: the file was truncated or the entry damaged")
        raw = pread_tensor(fd, size, 0, path)
    finally:
        os.close(fd)
    tensor = torch.from_numpy(raw.numpy().view(np.dtype(stored)).reshape(shape or (1,)))
    if stored != dtype_name:
        tensor = tensor.view(getattr(torch, dtype_name))
    return tensor.reshape(shape)


def _dat(weight: "torch.Tensor", weight_name: str, folder: str) -> tuple[str, Any, dict[str, Any]]:
    """(path, numpy array, index entry) of ``weight`` as ``<folder>/<weight_name>.dat`` (Accelerate's raw
    format), the entry with the checksum of the bytes to write."""
    import torch

    path = _inside(folder, weight_name, "offload_weight: weight_name")
    if weight.device.type == "meta":
        raise ValueError(f"offload: {weight_name!r} is on the meta device (no data); load or materialise it first")
    dtype_name = str(weight.dtype).replace("torch.", "")
    data = weight.detach().to("cpu").contiguous()
    stored = _numpy_stand_in(dtype_name)
    if stored != dtype_name:
        data = data.view(getattr(torch, stored))
    array = data.numpy()
    return path, array, {"dtype": dtype_name, "shape": list(array.shape), "checksum": _checksum(data)}


def _write_dat(weight: "torch.Tensor", weight_name: str, folder: str) -> dict[str, Any]:
    """Write ``weight`` to ``<folder>/<weight_name>.dat`` (Accelerate's raw format, atomically); its index
    entry, with the checksum of the bytes written."""
    path, array, entry = _dat(weight, weight_name, folder)
    with atomic_write(path, "wb") as f:
        f.write(array.tobytes())
    return entry


def offload_weight(weight: "torch.Tensor", weight_name: str, offload_folder: PathLike,
                   index: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """Write ``weight`` to ``<offload_folder>/<weight_name>.dat`` in Accelerate's raw format (atomically).

    index: a dict that gets the weight's entry (``{"dtype", "shape"}``, Accelerate's entry); it is returned.
    The file is not in the folder's ``index.json`` until ``save_offload_index`` writes the entries there,
    adding the checksum of each file's bytes that reading verifies.
    """
    entry = _write_dat(weight, weight_name, os.fspath(offload_folder))
    if index is not None:
        index[weight_name] = {"dtype": entry["dtype"], "shape": entry["shape"]}
    return index


def save_offload_index(index: Optional[Mapping[str, Any]], offload_folder: PathLike) -> None:
    """Merge ``index`` (entries from ``offload_weight``) into ``offload_folder``'s ``index.json``.

    The caller's dict is left as Accelerate's (``{"dtype", "shape"}``); in the file, each entry of a
    ``<name>.dat`` there gets the checksum of the file's bytes (read once, here), which reading checks."""
    folder = os.fspath(offload_folder)
    entries = {}
    for name, entry in (index or {}).items():
        entry = dict(entry)
        if "checksum" not in entry and "safetensors_file" not in entry:
            with contextlib.suppress(ValueError, OSError):  # no such file (yet): an entry without a checksum
                path = _inside(folder, name, "offload index entry")
                entry["checksum"] = _checksum(load_offloaded_weight(path, entry))  # refuses links, non-files
        entries[name] = entry
    add_to_index(folder, entries)


def load_offloaded_tensor(folder: Optional[str], name: str, entry: Mapping[str, Any],
                          device: Any = None) -> "torch.Tensor":
    """Read one tensor described by an index ``entry`` (on ``device``, default CPU)."""
    import torch

    file = entry.get("safetensors_file")
    if file is None:
        if folder is None:
            raise ValueError(f"offload entry {name!r} has no safetensors_file and no folder was given to read it from")
        tensor = _read_raw_array(folder, name, entry)
    else:
        # An index read from a folder names files inside it; an index the caller built may name any file.
        path = file if folder is None else _file_in(folder, file, name)
        tensor = _read_stored(path, entry.get("weight_name", name), entry, name)
        if "dtype" in entry and str(tensor.dtype).replace("torch.", "") != entry["dtype"]:
            dtype = getattr(torch, str(entry["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise _corrupt(f"the offload index entry of {name!r} (file {path!r}) has a damaged dtype {entry['dtype']!r}")
            tensor = tensor.to(dtype)
    return tensor if device is None else tensor.to(device)


def _read_stored(path: str, stored: str, entry: Mapping[str, Any], name: str) -> "torch.Tensor":
    """Tensor ``stored`` of the offload safetensors file ``path``, checked: a plain file, a whole header
    (``files.safetensors_format``), the index's shape, and the checksum the index records for the
    tensor's bytes, read once into memory of their own and summed there."""
    import torch

    from ..files.reading import pread_tensor
    from ..files.safetensors_format import CODES, header_length, parse_header

    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        head = header_length(bytes(pread_tensor(fd, min(size, 8), 0, path).numpy()), size, path)
        _, header = parse_header(bytes(pread_tensor(fd, head, 8, path).numpy()), size - 8 - head, path)
        info = header.get(stored)
        if info is None:
            raise _corrupt(f"the offload file {path!r} holds no tensor {stored!r} (for {name!r}); the file or the index "
                           "is damaged")
        dtype, shape, (start, end) = CODES[info["dtype"]], info["shape"], info["data_offsets"]
        if "shape" in entry and list(entry["shape"]) != shape:
            raise _corrupt(f"the offload file {path!r} stores {stored!r} with shape {shape}, the index says "
                           f"{entry['shape']}; the file or the index is damaged")
        tensor = pread_tensor(fd, end - start, 8 + head + start, path)
    finally:
        os.close(fd)
    _check_sum(tensor, entry, path, name)
    return tensor.view(dtype).view(shape) if tensor.numel() else torch.empty(shape, dtype=dtype)


def load_offloaded_weights(model: "torch.nn.Module", index: Optional[Mapping[str, Any]], offload_folder: PathLike) -> None:
    """Put every weight of ``index`` (tensor name -> entry) from ``offload_folder`` into ``model``, on the CPU.

    Reads Accelerate's ``.dat`` entries and hasten's safetensors entries alike.
    """
    from .modeling import set_module_tensor_to_device

    if not index:
        return
    if any("SCB" in name for name in index):
        raise NotImplementedError("load_offloaded_weights: the index holds bitsandbytes int8 statistics (SCB); hasten "
                                  "does not load 8-bit bitsandbytes weights, load the model without 8-bit quantization")
    folder = os.fspath(offload_folder)
    for name, entry in index.items():
        set_module_tensor_to_device(model, name, "cpu", value=load_offloaded_tensor(folder, name, entry))


class PrefixedDataset(Mapping):
    """A view of ``dataset`` whose keys are looked up with ``prefix`` in front (one module's weights)."""

    def __init__(self, dataset: Mapping, prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __contains__(self, key: object) -> bool:  # without reading the tensor
        return f"{self.prefix}{key}" in self.dataset

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return len(self.dataset)


class OffloadedWeightsLoader(Mapping):
    """Weights by name, from a dict kept in RAM (``state_dict``, looked up first) or an offload folder.

    Folder tensors are read from disk on every access and not cached, so only the weights of the
    module being run are in memory. ``index`` overrides the folder's ``index.json``; ``device``: where
    folder tensors are put (default CPU).
    """

    def __init__(self, state_dict: Optional[Mapping[str, "torch.Tensor"]] = None,
                 save_folder: Optional[PathLike] = None, index: Optional[Mapping] = None, device: Any = None) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index of offloaded weights")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else os.fspath(save_folder)
        if index is None and self.save_folder is not None:
            index = read_index(self.save_folder)
        self.index = {} if index is None else index
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device

    def __getitem__(self, key: str) -> "torch.Tensor":
        if key in self.state_dict:
            return self.state_dict[key]
        if key not in self.index:
            where = repr(os.path.join(self.save_folder, INDEX_NAME)) if self.save_folder else "the offload index"
            raise KeyError(f"weight {key!r} is not in {where}; the offload folder is incomplete or its index damaged")
        return load_offloaded_tensor(self.save_folder, key, self.index[key], self.device)

    def __contains__(self, key: object) -> bool:  # without reading the tensor
        return key in self.state_dict or key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)
