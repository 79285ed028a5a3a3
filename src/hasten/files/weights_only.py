"""What ``torch.load(weights_only=True)`` reads, through hasten's restricted unpickler instead of torch's.

torch's weights-only unpickler refuses code, but believes the sizes a file states: it calls
``bytearray(n)`` (and the legacy tensor classes with sizes) as asked, so a 30-byte pickle makes it
allocate 1 GiB before anything is wrong. Every torch file hasten reads without the user's explicit
``weights_only=False`` therefore goes through ``unpickling``'s allow-list unpickler, whose memo
indices, calls and storages are bounded by the file's real size before anything is allocated, with
the globals a weights-only load needs: tensors, parameters, plain containers, torch's dtypes,
layouts and devices, and bytes as pickle's protocol 2 writes them. Of the globals registered
process-wide with ``torch.serialization.add_safe_globals``, classes are honoured, as torch's reader
honours them (torchao registers its float8 weight tensor and configs, which DCP shards of an fp8
FSDP2 model hold); functions registered there are not. Tensor subclasses are rebuilt with
``_rebuild_wrapper_subclass``, which allocates no storage: their inner tensors are bounded storages.
"""

from __future__ import annotations

import io
import os
import types
from typing import Any

from . import unpickling

WEIGHTS_GLOBALS = unpickling.TENSOR_GLOBALS | frozenset({
    ("_codecs", "encode"),  # bytes, as pickle's protocol 2 (torch.save's) writes them; bounded in claim
    ("collections", "Counter"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"),  # a tensor on the meta device: no memory
    ("torch._utils", "_rebuild_wrapper_subclass"),  # a tensor subclass's shell: no storage of its own
})


def _registered_classes() -> frozenset:
    """The classes registered with ``torch.serialization.add_safe_globals`` (functions are left out)."""
    import torch

    found = set()
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, None)
        if isinstance(obj, type):
            module, _, attr = name.rpartition(".") if name else (obj.__module__, "", obj.__qualname__)
            found.add((module, attr))
    return frozenset(found)


def _module(source: str, kind: str, size: int) -> Any:
    """A pickle module for ``torch.load``'s ``pickle_module``: the restricted unpickler bound to ``source``,
    its calls and storages bounded by ``size`` (the bytes torch reads them from)."""
    reader = unpickling._unpickler(source, kind, WEIGHTS_GLOBALS | _registered_classes())
    reader.file_size = size
    return types.SimpleNamespace(__name__="hasten_weights_only", Unpickler=reader,
                                 load=lambda f, **kwargs: reader(f, **kwargs).load())


def load(path: str | os.PathLike, kind: str = "torch.save", map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` read through hasten's bounded allow-list unpickler, from one
    checked in-memory copy of the file (``unpickling.load_checked``). ``unpickling.ForbiddenGlobal`` for a
    global outside the list, ``ForbiddenPickle`` for a crafted size or a TorchScript archive,
    ``CheckpointCorruptError`` naming the file for a damaged one."""
    path = os.fspath(path)
    module = _module(path, kind, 0)  # load_checked sets the size of the copy it loads
    return unpickling.load_checked(path, kind, map_location=map_location, pickle_module=module, weights_only=False)


def load_bytes(data: Any, source: str, kind: str = "torch.save value", map_location: Any = "cpu") -> Any:
    """The same for bytes already read (a DCP value, a mapped file): checked (``check_torch_bytes``), then
    unpickled with every size bounded by ``len(data)``. Errors as ``load``'s; any failure that is not a
    refusal is ``CheckpointCorruptError`` naming ``source``."""
    import torch

    unpickling.check_torch_bytes(data, source, kind)
    module = _module(source, kind, len(data))
    stream = io.BytesIO(bytes(data))
    try:
        loaded = torch.load(stream, map_location=map_location, pickle_module=module, weights_only=False)
    except unpickling.ForbiddenPickle:
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - truncated or foreign bytes fail in many ways
        raise unpickling._corrupt(source, kind, f"{type(e).__name__}: {unpickling._first_line(e)}") from None
    if data[:4] != b"PK\x03\x04" and stream.tell() != len(data):  # legacy format: torch reads it to its end
        raise unpickling._refuse(source, kind, f"has {len(data) - stream.tell()} bytes after what torch.save wrote")
    return loaded
