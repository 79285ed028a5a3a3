"""Pickles of other libraries' checkpoint files, read with an allow-list: nothing in them can run code.

Two kinds of checkpoint file are pickles that hasten does not write itself: DCP's ``.metadata``
(sharded checkpoints) and DeepSpeed's ``*_states.pt``. A pickle may name any importable function
and have it called while it is read (``__reduce__``), so a replaced file runs code in the process
that loads it. The unpickler here resolves only the globals listed for the file's kind, and gives
saved attributes (pickle's BUILD) only to instances of the listed record classes, never to a class
or a function (which would change them for the whole process). Anything else raises
``ForbiddenPickle`` before it is called. This is the idea of ``torch.load(weights_only=True)``, with
an allow-list that belongs to one reader rather than to the process (torch's
``safe_globals``/``add_safe_globals`` are process-wide).

The reader is pickle's pure-Python unpickler: the C one cannot refuse a BUILD, and these files are
small (DCP metadata: a record per tensor; torch files: the pickle only, the tensor data is not
unpickled).
"""

from __future__ import annotations

import pickle
import types
from typing import Any, Iterable

# Records of torch.distributed.checkpoint's metadata (torch 2.x), and what they hold.
_DCP = "torch.distributed.checkpoint.metadata"
DCP_RECORDS = frozenset({
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"), (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})
DCP_GLOBALS = DCP_RECORDS | {
    (_DCP, "_MEM_FORMAT_ENCODING"),  # an Enum, rebuilt from its value
    ("torch.serialization", "_get_layout"),  # a layout from its name ("torch.strided")
    ("torch", "Size"),
    # StorageMeta.checkpoint_id: the folder DCP wrote to (pathlib's classes live in pathlib._local on 3.13+).
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
    ("pathlib._local", "PurePosixPath"), ("pathlib._local", "PureWindowsPath"),
}

# What torch.save writes for tensors and parameters (storages are resolved by torch.load itself).
TENSOR_GLOBALS = frozenset({
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
    ("torch", "Size"), ("torch", "device"),
})
_PLAIN = frozenset({("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                    ("builtins", "complex"), ("builtins", "bytearray")})


class ForbiddenPickle(pickle.UnpicklingError):
    """A checkpoint file names a global (or rebuilds an object) that files of its kind never hold."""


def _is_torch_constant(module: str, name: str) -> bool:
    """``torch.float32``, ``torch.strided``, ``torch.contiguous_format``: values pickled by name."""
    if module != "torch" or not name.isidentifier():
        return False
    import torch

    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class _Restricted(pickle._Unpickler):  # the pure-Python unpickler: its BUILD can be checked
    """Resolves only ``allowed``; BUILD only on instances of the ``records`` classes."""

    allowed: frozenset = frozenset()
    records: frozenset = frozenset()  # (module, name) of classes whose instances may get saved attributes
    source = ""  # the file, for messages
    kind = ""  # what it is, for messages

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buildable: set = set()  # the record classes this file resolved

    def refuse(self, what: str) -> ForbiddenPickle:
        return ForbiddenPickle(
            f"{self.source!r} is not a {self.kind} file as a checkpoint save writes it, or it was tampered with: "
            f"it {what}; hasten refused to unpickle it and nothing in it ran (load checkpoints only from "
            "sources you trust)")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed or (module, name) in _PLAIN or _is_torch_constant(module, name):
            found = super().find_class(module, name)
            if (module, name) in self.records:
                self.buildable.add(found)
            return found
        raise self.refuse(f"refers to the global {module}.{name}, which {self.kind} files never hold")

    def _load_build(self) -> None:
        cls = type(self.stack[-2])  # the object under the state it is given
        if cls not in self.buildable:
            raise self.refuse(f"sets saved attributes on a {cls.__module__}.{cls.__qualname__}, which {self.kind} "
                              "files never do")
        pickle._Unpickler.load_build(self)

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _load_build


def _unpickler(source: str, kind: str, allowed: Iterable[tuple[str, str]],
               records: Iterable[tuple[str, str]]) -> type:
    """An unpickler class bound to one file and one allow-list (torch.load takes a class, not an instance)."""
    return type("Restricted", (_Restricted,), {"allowed": frozenset(allowed), "records": frozenset(records),
                                               "source": source, "kind": kind})


def dcp_metadata(path: str) -> Any:
    """DCP's ``Metadata`` from the file ``path`` (a ``.metadata``), read with the DCP allow-list.

    Raises ``ForbiddenPickle`` for a file that names anything else, ``pickle.UnpicklingError`` for a
    file that is not DCP metadata (truncated, another format)."""
    from torch.distributed.checkpoint.metadata import Metadata

    reader = _unpickler(path, "DCP metadata", DCP_GLOBALS, DCP_RECORDS)
    with open(path, "rb") as f:
        try:
            metadata = reader(f).load()
        except ForbiddenPickle:
            raise
        except Exception as e:  # noqa: BLE001 - truncated or foreign files fail in many ways
            raise pickle.UnpicklingError(f"cannot read the DCP metadata {path!r} ({type(e).__name__}: {e}); the "
                                         "checkpoint is damaged or was written by another torch") from None
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"cannot read the DCP metadata {path!r}: it holds a {type(metadata).__name__}, "
                                     "not DCP metadata; the checkpoint is damaged")
    return metadata


def torch_file(path: str, kind: str, records: Iterable[tuple[str, str]], map_location: Any = "cpu",
               mmap: bool = False) -> Any:
    """``torch.load`` of ``path`` allowing tensors, plain containers, torch constants and ``records``
    (classes whose instances the file may hold). ``mmap=True`` maps the tensor data instead of reading
    it (zip-format files only; older ones are read)."""
    import torch

    records = frozenset(records)
    reader = _unpickler(path, kind, TENSOR_GLOBALS | records, records | {("collections", "OrderedDict")})
    # torch.load takes any module-like object with Unpickler and load (a per-call allow-list, no global switch).
    module = types.SimpleNamespace(__name__="hasten_restricted_pickle", Unpickler=reader,
                                   load=lambda f, **kwargs: reader(f, **kwargs).load())
    try:
        return torch.load(path, map_location=map_location, pickle_module=module, weights_only=False, mmap=mmap)
    except RuntimeError as e:
        if not mmap or "mmap" not in str(e):
            raise
    return torch.load(path, map_location=map_location, pickle_module=module, weights_only=False)

