"""Pickles of other libraries' checkpoint files, read with an allow-list: nothing in them can run code.

Two kinds of checkpoint file are pickles that hasten does not write itself: DCP's ``.metadata``
(sharded checkpoints) and DeepSpeed's ``*_states.pt``. A pickle may name any importable function
and have it called while it is read (``__reduce__``), so a replaced file runs code in the process
that loads it. The unpickler here resolves only the globals listed for the file's kind and raises
``ForbiddenPickle`` for any other, before it is called: the idea of ``torch.load(weights_only=True)``,
with an allow-list that belongs to one reader rather than to the process (torch's
``safe_globals``/``add_safe_globals`` are process-wide).

A pickle can also hand saved attributes (its BUILD) to any object it holds, including a class or a
function it resolved, which would change them for the whole process. Functions are therefore
given to it wrapped (``_Call``: callable, refusing attributes), and the classes it resolved (and
their enum members) are compared before and after: a change is undone and refused. This keeps
pickle's C unpickler (the pure-Python one, which could check BUILD directly, is ~30x slower: 20 ms
per hundred DCP tensors).

The pickle module is not the only door: ``torch.load`` hands any zip archive whose records include
``constants.pkl`` (a TorchScript archive) to ``torch.jit.load``, which runs the archive's code, whatever
pickle module it was given. ``torch_file`` therefore copies a file once into memory (a sealed memfd on
Linux, which nobody can change afterwards; else bytes), checks that copy (``check_torch_bytes``: a zip
archive holding only the records torch.save writes, as both Python's zipfile and torch's own reader
list them, or a legacy pickle) and unpickles exactly that copy: no second read of the file that a
replaced file could slip into. Any failure is one error naming the file:
``ForbiddenPickle`` (it would run code, or names a foreign global) or ``CheckpointCorruptError``.
"""

from __future__ import annotations

import collections
import enum
import errno
import io
import math
import os
import pickle
import re
import types
import zlib
from typing import Any, Callable, Iterable, Optional

from .pickle_scan import scan_pickle

# Records of torch.distributed.checkpoint's metadata (torch 2.x), and what they hold.
_DCP = "torch.distributed.checkpoint.metadata"
DCP_GLOBALS = frozenset({
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"), (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    (_DCP, "_MEM_FORMAT_ENCODING"),  # an Enum, rebuilt from its value
    # What metadata written by torch 2.0/2.1 names for the tensor properties.
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),  # a layout from its name ("torch.strided")
    ("torch", "Size"),
    # StorageMeta.checkpoint_id: the folder DCP wrote to (pathlib's classes live in pathlib._local on 3.13+).
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
    ("pathlib._local", "PurePosixPath"), ("pathlib._local", "PureWindowsPath"),
})

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


class ForbiddenGlobal(ForbiddenPickle):
    """The refusal of a global outside the reader's allow-list (the case where trusting the file is the fix)."""


def _is_torch_constant(module: str, name: str) -> bool:
    """``torch.float32``, ``torch.strided``, ``torch.contiguous_format``: values pickled by name."""
    if module != "torch" or not name.isidentifier():
        return False
    import torch

    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class _Changed(Exception):
    """Raised inside a load whose pickle tried to change a resolved class or function."""


class _Call:
    """A function a pickle may call (its REDUCE), and nothing more: saved attributes are refused. A call
    whose arguments claim more memory than the file holds (``bytearray(1 << 30)`` in a 32-byte file, a
    tensor view past its storage) is refused before anything is allocated (``unpickler.claim``)."""

    __slots__ = ("function", "unpickler")

    def __init__(self, function: Any, unpickler: Any = None) -> None:
        self.function = function
        self.unpickler = unpickler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.unpickler is not None:
            args = self.unpickler.claim(self.function, args, kwargs)
        return self.function(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        raise _Changed(f"sets saved attributes on the function {self.function.__module__}."
                       f"{self.function.__qualname__}")


def _snapshot(obj: Any) -> tuple:
    """What a pickle's BUILD could change on ``obj`` (references, so a replaced value is noticed)."""
    attrs = getattr(obj, "__dict__", None)
    return (type(obj), getattr(obj, "__bases__", None), getattr(obj, "__name__", None),
            getattr(obj, "__qualname__", None), None if attrs is None else dict(attrs))


def _same(before: tuple, after: tuple) -> bool:
    if any(a is not b and a != b for a, b in zip(before[:4], after[:4])):
        return False
    old, new = before[4], after[4]
    return old is None and new is None or (old is not None and new is not None and old.keys() == new.keys()
                                           and all(new[k] is v for k, v in old.items()))


def _restore(obj: Any, before: tuple) -> None:
    """Undo what a pickle changed on a class or an enum member (best effort: the load is refused anyway)."""
    cls, bases, name, qualname, attrs = before
    for attr, value in (("__class__", cls), ("__bases__", bases), ("__name__", name), ("__qualname__", qualname)):
        if value is not None and getattr(obj, attr, None) is not value:
            setattr(obj, attr, value)
    if attrs is None:
        return
    if isinstance(obj, type):
        for key in [k for k in vars(obj) if k not in attrs]:
            delattr(obj, key)
        for key, value in attrs.items():
            if vars(obj).get(key) is not value:
                setattr(obj, key, value)
    else:
        obj.__dict__.clear()
        obj.__dict__.update(attrs)


class _Restricted(pickle.Unpickler):
    """Resolves only ``allowed`` (plus plain containers and torch's dtypes, layouts, memory formats)."""

    allowed: frozenset = frozenset()
    source = ""  # the file, for messages
    kind = ""  # what it is, for messages

    file_size = 0  # the whole file's size when the pickle is one record of it (torch's zip archive)

    def __init__(self, file: Any, *args: Any, **kwargs: Any) -> None:
        # Every size the pickle states is bounded by the bytes it came with, checked before anything is
        # allocated: its memo indices before the C unpickler runs (it sizes its memo by the largest index),
        # the sizes given to allowed calls and storages while it runs.
        self.limit = max(scan_pickle(file, self.refuse), type(self).file_size)
        super().__init__(file, *args, **kwargs)
        self.guarded: dict[int, tuple[Any, tuple]] = {}  # id -> (class or enum member, snapshot)
        self.allocated = 0  # bytes the pickle's calls allocated so far: together bounded by ``limit`` too

    def __setattr__(self, name: str, value: Any) -> None:
        # torch.load sets ``unpickler.persistent_load``: its storages are allocated from the size the pickle
        # claims (torch's legacy format reads the bytes afterwards), so the claim is checked first.
        if name == "persistent_load" and callable(value):
            function = value

            def value(saved_id: Any) -> Any:
                if isinstance(saved_id, tuple) and len(saved_id) >= 5 and isinstance(saved_id[4], int):
                    self._bound(saved_id[4] * _element_size(saved_id[1]), f"a storage of {saved_id[4]} elements")
                return function(saved_id)

        super().__setattr__(name, value)

    def _bound(self, nbytes: int, what: str) -> None:
        if not 0 <= nbytes <= self.limit:
            raise self.refuse(f"claims {what} ({nbytes} bytes), more than the {self.limit} bytes it holds")

    def claim(self, function: Any, args: tuple, kwargs: dict) -> tuple:
        """Check the sizes a call's arguments claim against ``limit``; returns the arguments to call with."""
        name = getattr(function, "__qualname__", "")
        if function is bytearray and args and isinstance(args[0], int):
            self._allocate(args[0], f"bytearray({args[0]})")
        elif function in _COPYING and args and hasattr(args[0], "__len__"):
            # a copy of a value the pickle may reference many times (its memo): each copy is counted
            self._allocate(len(args[0]), f"{function.__name__} of {len(args[0])} items")
        elif function in _TENSOR_TYPES():
            dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
            if all(isinstance(d, int) for d in dims):
                self._allocate(8 * math.prod(dims), f"an uninitialized tensor of shape {tuple(dims)}")
        elif getattr(function, "__module__", "") == "_codecs" and name == "encode":
            # pickle's protocol 2 writes bytes as encode(text, "latin1"); other codecs grow their input
            # (hex doubles it), so chained calls would turn a few bytes into gigabytes.
            text, encoding = (tuple(args) + ("utf-8",))[:2] if args else (None, None)
            if not (isinstance(text, str) and isinstance(encoding, str) and not kwargs
                    and encoding.lower().replace("-", "_") in ("latin1", "latin_1", "iso8859_1")):
                raise self.refuse(f"calls _codecs.encode with {type(text).__name__} and {encoding!r}, which pickle "
                                  "never writes (only text encoded as latin1)")
            self._allocate(len(text), f"bytes of {len(text)} characters")
        elif name.startswith("_rebuild_tensor") and len(args) >= 4:
            self._bound_view(*args[:4], dtype=args[6] if name == "_rebuild_tensor_v3" and len(args) > 6 else None)
        elif name == "_rebuild_from_type_v2" and len(args) >= 2 and isinstance(args[1], _Call):
            args = (args[0], args[1].function, *args[2:])  # the tensor class itself, handed out wrapped
        return args

    def _bound_view(self, storage: Any, offset: Any, size: Any, stride: Any, dtype: Any = None) -> None:
        """A tensor rebuilt from ``storage``: torch's ``set_`` grows a storage too small for the view."""
        if not (isinstance(offset, int) and isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list))
                and len(size) == len(stride) and all(isinstance(d, int) for d in (*size, *stride))):
            return  # torch rejects it itself
        if offset < 0 or any(d < 0 for d in (*size, *stride)):
            raise self.refuse(f"rebuilds a tensor with a negative offset, size or stride ({offset}, {size}, {stride})")
        if 0 in size:
            return
        item = _element_size(dtype if dtype is not None else storage)
        needed = (offset + sum((d - 1) * s for d, s in zip(size, stride)) + 1) * item
        untyped = getattr(storage, "_untyped_storage", storage)  # a TypedStorage (asked directly, torch warns)
        nbytes = untyped.nbytes() if hasattr(untyped, "nbytes") else None
        if nbytes is None or needed > nbytes:
            raise self.refuse(f"rebuilds a tensor of shape {tuple(size)} needing {needed} bytes from a storage of "
                              f"{nbytes} bytes")

    def _allocate(self, nbytes: int, what: str) -> None:
        """A call's allocation, bounded alone and with every earlier one (many small claims add up)."""
        self._bound(nbytes, what)
        self.allocated += nbytes
        if self.allocated > self.limit:
            raise self.refuse(f"allocates {self.allocated} bytes in its calls ({what} the last), more than the "
                              f"{self.limit} bytes it holds")

    def refuse(self, what: str, error: type = ForbiddenPickle) -> ForbiddenPickle:
        return error(
            f"{self.source!r} is not a {self.kind} file as a checkpoint save writes it, or it was tampered with: "
            f"it {what}; hasten refused to unpickle it and nothing in it ran (load checkpoints only from "
            "sources you trust)")

    def find_class(self, module: str, name: str) -> Any:
        import _compat_pickle  # Python 2 names, which pickle's protocol 2 (torch.save's) writes for builtins

        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if not ((module, name) in self.allowed or (module, name) in _PLAIN or _is_torch_constant(module, name)):
            raise self.refuse(f"refers to the global {module}.{name}, which {self.kind} files never hold",
                              ForbiddenGlobal)
        found = super().find_class(module, name)
        if found in _COPYING or found in _TENSOR_TYPES():  # classes whose call takes a size or copies
            return _Call(found, self)
        if isinstance(found, type):
            members = list(found.__members__.values()) if issubclass(found, enum.Enum) else []
            for obj in (found, *members):
                self.guarded.setdefault(id(obj), (obj, _snapshot(obj)))
            return found
        return _Call(found, self) if callable(found) else found

    def load(self) -> Any:
        try:
            result = super().load()
        except _Changed as e:
            self._changed()
            raise self.refuse(str(e)) from None
        except BaseException:
            self._changed()
            raise
        changed = self._changed()
        if changed:
            raise self.refuse(f"changes {changed}, which {self.kind} files never do")
        return result

    def _changed(self) -> str:
        """Undo changes to the guarded classes; the first one changed (empty when none was)."""
        changed = ""
        for obj, before in self.guarded.values():
            if not _same(before, _snapshot(obj)):
                _restore(obj, before)
                changed = changed or f"the class or value {obj!r}"
        return changed


_COPYING = (bytearray, set, frozenset, collections.OrderedDict, collections.Counter)


def _TENSOR_TYPES() -> tuple:
    """The tensor classes a pickle may name: called, they allocate a tensor of the sizes given."""
    import torch

    return (torch.Tensor, torch.nn.Parameter)


def _element_size(kind: Any) -> int:
    """Bytes per element of a storage type, a storage or a dtype (1 for untyped storages)."""
    import torch

    dtype = kind if isinstance(kind, torch.dtype) else getattr(kind, "dtype", torch.uint8)
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 1


def _unpickler(source: str, kind: str, allowed: Iterable[tuple[str, str]]) -> type:
    """An unpickler class bound to one file and one allow-list (torch.load takes a class, not an instance)."""
    return type("Restricted", (_Restricted,), {"allowed": frozenset(allowed), "source": source, "kind": kind})


def dcp_metadata(path: str, data: Optional[bytes] = None) -> Any:
    """DCP's ``Metadata`` from the file ``path`` (a ``.metadata``), read with the DCP allow-list
    (from ``data``, its bytes already read and verified, when given).

    Raises ``ForbiddenPickle`` for a file that names anything else, ``pickle.UnpicklingError`` for a
    file that is not DCP metadata (truncated, another format)."""
    from torch.distributed.checkpoint.metadata import Metadata

    reader = _unpickler(path, "DCP metadata", DCP_GLOBALS)
    with (io.BytesIO(data) if data is not None else os.fdopen(open_no_link(path), "rb")) as f:  # no link
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


# The records torch.save writes into its zip archive (under one archive prefix). A TorchScript archive
# adds constants.pkl and code/: torch.load hands any zip with constants.pkl to torch.jit.load, whatever
# pickle module it was given, and TorchScript runs the archive's code (its __setstate__ can write files).
_TORCH_SAVE_RECORDS = re.compile(r"(data\.pkl|byteorder|version|\.data/version|\.data/serialization_id|"
                                 r"\.format_version|\.storage_alignment|data/\d+)\Z")


def _corrupt(path: str, kind: str, what: str) -> Exception:
    from .errors import CheckpointCorruptError

    return CheckpointCorruptError(f"{path!r} is not a readable {kind} file: {what}; the checkpoint is incomplete or "
                                  "damaged (save it again, or restore the file from a good copy)")


def _refuse(path: str, kind: str, what: str) -> ForbiddenPickle:
    return ForbiddenPickle(f"{path!r} is not a {kind} file as torch.save writes it, or it was tampered with: it "
                           f"{what}; hasten refused to load it and nothing in it ran (load checkpoints only from "
                           "sources you trust)")


def _check_crcs(data: Any, infos: list, path: str, kind: str) -> None:
    """Each stored record's CRC-32 (torch.save records one; torch.load does not check it): a flipped bit
    in an Accelerate-format ``.bin`` is found here instead of loading as different numbers. The views are
    released before any error leaves (``data`` may be a map its caller closes)."""
    with memoryview(data) as whole, whole.cast("B") as view:
        problem = None
        for info in infos:
            start = info.header_offset
            local = bytes(view[start:start + 30])
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                problem = f"its zip record {info.filename!r} has no local header where the directory says"
                break
            name_end = start + 30 + int.from_bytes(local[26:28], "little")
            if bytes(view[start + 30:name_end]) != info.orig_filename.encode("utf-8"):
                problem = f"its zip record {info.filename!r} is named differently in its local header"
                break
            begin = name_end + int.from_bytes(local[28:30], "little")
            with view[begin:begin + info.compress_size] as record:
                if len(record) != info.compress_size:
                    problem = f"its zip record {info.filename!r} is cut short"
                    break
                if info.CRC and zlib.crc32(record) != info.CRC:
                    problem = f"its zip record {info.filename!r} fails its CRC-32 (a flipped bit or an edited file)"
                    break
    if problem:
        raise _corrupt(path, kind, problem + " (damaged or truncated)")


def _check_zip(data: Any, path: str, kind: str, stream: Callable[[], Any]) -> None:
    """Refuse a zip archive holding anything but torch.save's records, as Python's zipfile and torch's own
    reader (the one torch.load uses) both see it."""
    import zipfile

    import torch

    if data[-22:-18] != b"PK\x05\x06" or bytes(data[-2:]) != b"\0\0":  # torch writes no comment, nothing after
        raise _refuse(path, kind, "has data after its zip directory (a comment, an appended archive) or no end record")
    def unreadable(e: Exception) -> Exception:
        return _corrupt(path, kind, f"its zip archive cannot be read ({type(e).__name__}: {_first_line(e)})")

    try:
        with stream() as f, zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
    except Exception as e:  # noqa: BLE001 - zipfile.BadZipFile, ...
        raise unreadable(e) from None
    for info in infos:  # readers allocate a record's claimed size to read it: a stored record holds its bytes
        if info.compress_type != zipfile.ZIP_STORED:
            continue  # refused below before any record is read (as torch.save never writes, or TorchScript)
        if info.file_size != info.compress_size or info.header_offset + 30 + info.compress_size > len(data):
            raise _corrupt(path, kind, f"its zip record {info.filename!r} claims {info.file_size} bytes, more than "
                           f"the file's {len(data)} bytes hold (truncated, or a crafted size)")
    try:
        with stream() as f:
            torch_records = torch._C.PyTorchFileReader(f).get_all_records()
    except Exception as e:  # noqa: BLE001 - RuntimeError of torch's reader, ...
        raise unreadable(e) from None
    names = [info.filename for info in infos]
    if not names or len(set(names)) != len(names):
        raise _refuse(path, kind, "is a zip archive with no records or with a record named twice")
    prefix = names[0].split("/", 1)[0]
    for info in infos:
        head, _, rest = info.filename.partition("/")
        if head != prefix or not _TORCH_SAVE_RECORDS.match(rest):
            raise _refuse(path, kind, f"holds the zip record {info.filename!r}, which torch.save never writes (a "
                          "TorchScript archive, whose code torch.load would run, holds code/ and constants.pkl)")
        if info.flag_bits & 0x1 or info.compress_type != zipfile.ZIP_STORED:
            raise _refuse(path, kind, f"holds the record {info.filename!r} encrypted or compressed, as torch.save "
                          "never writes it")
    if min(info.header_offset for info in infos) != 0:
        raise _refuse(path, kind, "has data before its first zip record")
    _check_crcs(data, infos, path, kind)
    if sorted(torch_records) != sorted(name.partition("/")[2] for name in names):
        raise _refuse(path, kind, "is a zip archive whose records torch's reader sees differently from zipfile")


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else "no message"


def check_torch_bytes(data: Any, path: str, kind: str, stream: Optional[Callable[[], Any]] = None) -> None:
    """Raise unless ``data`` (the bytes of ``path``, or a read-only map of them; ``stream`` opens them as a
    file) is what torch.save writes: a zip archive of its records only (``ForbiddenPickle`` for a TorchScript
    archive or any other record), or a pickle (torch's legacy format, whose globals the unpickler then
    judges). ``CheckpointCorruptError`` for an empty or unreadable file."""
    if stream is None:
        stream = lambda: io.BytesIO(data)  # noqa: E731
    if not len(data):
        raise _corrupt(path, kind, "it is empty")
    if data[:4] == b"PK\x03\x04":
        _check_zip(data, path, kind, stream)
        return
    if data[:1] != b"\x80":  # torch's legacy format starts with a pickle (protocol 2+); not a tar archive
        raise _corrupt(path, kind, "it is neither a zip archive nor a pickle as torch.save writes them")
    import tarfile

    try:
        with stream() as f:
            tarfile.open(fileobj=f, mode="r:").close()
    except tarfile.TarError:
        return
    raise _refuse(path, kind, "is a tar archive (torch < 0.4's format)")


def open_no_link(path: str) -> int:
    """A read-only descriptor of the plain file ``path``, never through a symbolic link (``paths.open_inside``)."""
    from .paths import open_inside, split

    return open_inside(*split(path), "file", nested=False)


def read_checked(path: str, kind: str) -> bytes:
    """The bytes of ``path``, read once and checked by ``check_torch_bytes``: what is then unpickled is
    exactly what was checked (no second read a replaced file could slip into)."""
    from .errors import UnsafeFileError

    try:
        with os.fdopen(open_no_link(path), "rb") as f:
            data = f.read()
    except UnsafeFileError as e:
        raise _corrupt(path, kind, f"it is not a plain file inside its folder ({e})") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _corrupt(path, kind, "it is a symbolic link, which may lead anywhere; hasten reads only real "
                           "files of a checkpoint (nothing was read)") from None
        raise _corrupt(path, kind, f"it cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    check_torch_bytes(data, path, kind)
    return data


def _sealed_copy(path: str) -> Optional[int]:
    """A private in-memory copy of ``path`` (a Linux memfd) sealed against any change, or None where the
    system has none (then the file is read into bytes instead). The copy is what is checked and what torch
    maps: one copy of the bytes, torch's fast path-based loading, and nobody can alter it in between."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    if not (hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")):
        return None
    try:
        source = open_no_link(path)
    except OSError:
        return None  # read_checked names the file and the reason
    fd = -1
    try:
        size = os.fstat(source).st_size
        fd = os.memfd_create("hasten-checked", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        done = 0
        while done < size:
            sent = os.sendfile(fd, source, done, size - done)
            if not sent:  # the file shrank while it was copied: what was copied is checked
                break
            done += sent
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except OSError:  # a file system sendfile cannot read, no sealing: the plain read below
        if fd >= 0:
            os.close(fd)
        return None
    finally:
        os.close(source)
    return fd


def torch_file(path: str, kind: str, records: Iterable[tuple[str, str]], map_location: Any = "cpu",
               mmap: bool = False) -> Any:
    """``torch.load`` of ``path`` allowing tensors, plain containers, torch constants and ``records``
    (classes whose instances the file may hold), through ``load_checked``. ``mmap`` is accepted for
    callers of old and ignored: mapping the file itself would let what torch reads differ from what was
    checked (the checked copy is mapped instead).

    Raises ``ForbiddenPickle`` for a file that would run code or names a global outside the list, and
    ``CheckpointCorruptError`` naming the file for any other failure (empty, truncated, bit flips,
    pickles nested too deep)."""
    del mmap
    reader = _unpickler(path, kind, TENSOR_GLOBALS | frozenset(records))
    # torch.load takes any module-like object with Unpickler and load (a per-call allow-list, no global switch).
    module = types.SimpleNamespace(__name__="hasten_restricted_pickle", Unpickler=reader,
                                   load=lambda f, **kwargs: reader(f, **kwargs).load())
    return load_checked(path, kind, map_location=map_location, pickle_module=module, weights_only=False)


def load_checked(path: str, kind: str, refused: tuple = (ForbiddenPickle,), **load_kwargs: Any) -> Any:
    """``torch.load(..., **load_kwargs)`` of ``path``, copied once into a sealed in-memory file
    (``_sealed_copy``; else read into bytes), checked (``check_torch_bytes``: never a TorchScript archive,
    whatever ``weights_only``) and loaded from that very copy, zip archives mapped rather than copied
    again. Errors of the classes ``refused`` pass unchanged (the unpickler's refusals); any other failure is
    ``CheckpointCorruptError`` naming the file."""
    import mmap as mapping

    fd = _sealed_copy(path)
    reader = getattr(load_kwargs.get("pickle_module"), "Unpickler", None)
    bounded = isinstance(reader, type) and issubclass(reader, _Restricted)
    if fd is None:
        data = read_checked(path, kind)
        if bounded:  # the storages of torch's archive are records beside data.pkl: bounded by the file
            reader.file_size = len(data)
        return _load(path, kind, data, lambda: io.BytesIO(data), None, refused, load_kwargs)
    try:
        size = os.fstat(fd).st_size
        if not size:
            raise _corrupt(path, kind, "it is empty")
        if bounded:
            reader.file_size = size
        with mapping.mmap(fd, size, prot=mapping.PROT_READ) as view:
            sealed = f"/proc/self/fd/{fd}"
            stream = lambda: open(sealed, "rb")  # noqa: E731 - its own file position, the same sealed bytes
            check_torch_bytes(view, path, kind, stream)
            return _load(path, kind, view, stream, sealed, refused, load_kwargs)
    finally:
        os.close(fd)


def _load(path: str, kind: str, data: Any, stream: Callable[[], Any], sealed: Optional[str], refused: tuple,
          load_kwargs: dict) -> Any:
    """Unpickle checked bytes: a zip archive from the sealed copy's path (mapped), else from a stream that
    must end where torch.save's legacy format ends."""
    import torch

    load_kwargs.setdefault("map_location", "cpu")
    try:
        if sealed is not None and data[:4] == b"PK\x03\x04":
            return torch.load(sealed, mmap=True, **load_kwargs)
        with stream() as f:
            loaded = torch.load(f, **load_kwargs)
            end = f.tell()
    except refused:
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - truncated, flipped or foreign files fail in many ways
        raise _corrupt(path, kind, f"{type(e).__name__}: {_first_line(e)}") from None
    if data[:4] != b"PK\x03\x04" and end != len(data):  # legacy format: torch reads it to its end
        raise _refuse(path, kind, f"has {len(data) - end} bytes after what torch.save wrote")
    return loaded
