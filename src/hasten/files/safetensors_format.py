"""The safetensors format, read and written in one place.

Reading: ``parse_header`` is the one parser of a safetensors header (length, JSON, metadata, every
tensor entry checked before any view is made); ``SafetensorsView`` gives tensor views of a file's
bytes already read into memory (``reading.ReadFile``), never of the file itself.

Writing: every checkpoint file is written here without extra copies (``safetensors.torch.save_file``
first copies every tensor into a ``bytes`` object), big files past the page cache (O_DIRECT), which
makes a durable save about as fast as the disk, summed (bsum64) while written. The files are plain
safetensors with tensors ordered by decreasing item size, so every tensor is aligned for its dtype.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import sys
import threading
from typing import Any, Optional

import torch

from .checksum import BlockSummer, as_bytes_tensor
from .checksum_fields import block_metadata, seal_header
from .durable import fsync_fd
from .errors import CheckpointCorruptError

# safetensors dtype codes
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
CODES = {code: dtype for dtype, code in DTYPES.items()}



def header_length(head: bytes, size: int, path: str) -> int:
    """The JSON header's length from a file's first 8 bytes; raises unless the file can hold it."""
    if size < 8 or len(head) < 8:
        raise CheckpointCorruptError(f"{path!r} is not a safetensors file: it has {size} bytes (truncated or emptied)")
    n = int.from_bytes(head[:8], "little")
    if n > size - 8:
        raise CheckpointCorruptError(f"{path!r} is damaged or truncated: its header length claims {n} bytes and the file "
                                     f"has {size}")
    return n


def parse_header(text: bytes, data_size: int, path: str) -> tuple[dict[str, str], dict[str, dict]]:
    """(metadata, tensor entries) of a safetensors header's JSON ``text``, every entry checked
    against the ``data_size`` bytes that follow the header; ``CheckpointCorruptError`` naming
    ``path`` otherwise."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path!r} has an unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path!r} has a damaged safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointCorruptError(f"{path!r} has a damaged safetensors header (metadata)")
    for name, entry in header.items():
        problem = entry_problem(entry, data_size)
        if problem:
            raise CheckpointCorruptError(f"{path!r} has a damaged safetensors header: tensor {name!r} {problem}")
    return metadata, header


def entry_problem(entry: Any, data_size: int) -> Optional[str]:
    """What is wrong with one tensor entry of a safetensors header (None: nothing), checked before
    any view is made: dtype known, shape of non-negative ints, offsets inside the data and matching
    the shape's byte count."""
    if not isinstance(entry, dict):
        return "is not described by an object"
    dtype = CODES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
    if dtype is None:
        return f"has unknown dtype {entry.get('dtype')!r}"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"has an invalid shape {shape!r}"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        return f"has data offsets {offsets!r} outside the file's {data_size} data bytes"
    numel = 1
    for d in shape:
        numel *= d
    if (offsets[1] - offsets[0]) != numel * torch.empty((), dtype=dtype).element_size():
        return f"has {offsets[1] - offsets[0]} data bytes for shape {shape} of {entry['dtype']}"
    return None


class SafetensorsView:
    """Header and zero-copy tensor views of a safetensors file's bytes held in memory (``file.raw``,
    a uint8 tensor: ``reading.ReadFile`` reads a file into private memory once)."""

    def __init__(self, file: Any) -> None:
        self.path = file.path
        self.found = file.found  # the checksum of the bytes read (None: not summed)
        raw = file.raw  # not ``file`` itself: ``read_weights`` hangs the view on the file, and a cycle would keep
        # the file's memory until the garbage collector next runs
        n = header_length(bytes(raw[:8].numpy().tobytes()), raw.numel(), file.path)
        self.metadata, self.entries = parse_header(bytes(raw[8:8 + n].numpy().tobytes()), raw.numel() - 8 - n,
                                                   file.path)
        self._data = raw[8 + n:]

    def shapes(self) -> dict[str, tuple]:
        return {k: tuple(v["shape"]) for k, v in self.entries.items()}

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = CODES[entry["dtype"]]  # checked by parse_header
        start, end = entry["data_offsets"]
        piece = self._data[start:end]
        shape = entry["shape"]
        if piece.numel() == 0:
            return torch.empty(shape, dtype=dtype)
        if dtype == torch.complex64:
            if piece.data_ptr() % 4:
                piece = piece.clone()
            return torch.view_as_complex(piece.view(torch.float32).view(*shape, 2))
        itemsize = torch.empty((), dtype=dtype).element_size()
        if piece.data_ptr() % itemsize:  # a file from another writer may leave tensors unaligned
            piece = piece.clone()
        return piece.view(dtype).view(shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.entries}


# -- writing ---------------------------------------------------------------------------------------
def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


_CHUNK = 64 << 20
_SYNC_FILE_RANGE: list = []


def _kick_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a range to disk now (Linux ``sync_file_range``), so the final fsync has little
    left to wait for; a no-op elsewhere. Durability still comes from the fsync."""
    if not _SYNC_FILE_RANGE:
        function = None
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).sync_file_range
                function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            except (OSError, AttributeError):
                function = None
        _SYNC_FILE_RANGE.append(function)
    function = _SYNC_FILE_RANGE[0]
    if function is not None:
        function(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None,
                      block_size: Optional[int] = None) -> tuple[int, str]:
    """Write ``tensors`` as a safetensors file at ``path``, fsync it; returns (size, checksum).

    Tensors must not share memory (the caller drops tied duplicates). The checksum runs inline, at
    memory speed: computed on a second thread beside the writes it made saves slower and less steady
    on a 2-core machine (it competes with the kernel's writeback). ``block_size``: also record the
    checksum of every ``block_size`` bytes of the data and of the header itself (``checksum_fields``; ``ranged``: the file can
    then be read and verified in parts), summed in a pass over the tensors before the write.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    prepared = {k: _cpu_contiguous(tensors[k]) for k in order}
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        t = prepared[name]
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot store tensor {name!r} of dtype {t.dtype} in a checkpoint; convert it first")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if block_size:
        header.setdefault("__metadata__", {}).update(
            block_metadata([as_bytes_tensor(prepared[name]) for name in order], block_size))
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)  # data starts 8-aligned
    head = len(text).to_bytes(8, "little") + text
    if block_size:
        head = seal_header(head, path)
    pieces = [head] + [raw for raw in (as_bytes_tensor(prepared[name]) for name in order) if raw.numel()]
    size = len(head) + offset
    if size >= _DIRECT_MIN:
        summer = BlockSummer()
        if _write_direct(path, pieces, size, summer):
            return size, summer.digest()
    summer = BlockSummer()  # a refused direct write may have summed some pieces already
    _write_buffered(path, pieces, summer)
    return size, summer.digest()


def _view(piece: Any) -> memoryview:
    """The bytes of a piece (``bytes`` or a flat uint8 CPU tensor) without a copy."""
    return memoryview(piece.numpy()) if isinstance(piece, torch.Tensor) else memoryview(piece)


def _write_buffered(path: str, pieces: list, summer: BlockSummer) -> None:
    """Through the page cache: writeback of each chunk is started at once, then one fsync."""
    with open(path, "wb", buffering=0) as f:
        position = 0
        for piece in pieces:
            summer.update(piece)
            view = _view(piece)
            while view:
                written = f.write(view[:_CHUNK])
                _kick_writeback(f.fileno(), position, written)
                position += written
                view = view[written:]
        fsync_fd(f.fileno(), path)


# Big files bypass the page cache (O_DIRECT, Linux): the data goes from an aligned buffer to the
# disk once, instead of being copied into the page cache and flushed by the fsync, which on the
# machines we measured made durable saves faster and much steadier, and checkpoints stop evicting
# the training job's cached data. Filesystems that refuse O_DIRECT get the buffered path.
_DIRECT_MIN = 16 << 20
_DIRECT_BUFFER = 8 << 20
_ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
_NO_DIRECT: set = set()  # devices where O_DIRECT failed


def _write_direct(path: str, pieces: list, size: int, summer: BlockSummer) -> bool:
    """Write ``pieces`` with O_DIRECT and fsync; False (nothing left behind) where unsupported.

    Two aligned buffers: while a thread writes one to the disk, the next is filled and its
    checksum computed (from the buffer, still in the CPU cache, instead of a second pass over the
    tensors in memory).
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        device = os.stat(os.path.dirname(path) or ".").st_dev
    except OSError:
        return False
    if device in _NO_DIRECT:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        _NO_DIRECT.add(device)
        return False
    buffers = [mmap.mmap(-1, _DIRECT_BUFFER) for _ in range(2)]  # page-aligned
    views = [memoryview(b) for b in buffers]
    pending: list = []  # [thread, error list]

    def flush(index: int, length: int, position: int) -> None:
        summer.update(torch.frombuffer(buffers[index], dtype=torch.uint8, count=length))
        wait()
        errors: list = []
        padded = -(-length // _ALIGN) * _ALIGN  # the tail is padded; the file is cut to size below
        if padded > length:
            views[index][length:padded] = bytes(padded - length)

        def run() -> None:
            try:
                _pwrite_all(fd, views[index][:padded], position)
            except OSError as e:
                errors.append(e)

        thread = threading.Thread(target=run, name="hasten-direct-write")
        thread.start()
        pending[:] = [thread, errors]

    def wait() -> None:
        if pending:
            pending[0].join()
            if pending[1]:
                raise pending[1][0]
            pending.clear()

    try:
        index, filled, position = 0, 0, 0
        for piece in pieces:
            view = _view(piece)
            while view:
                take = min(len(view), _DIRECT_BUFFER - filled)
                views[index][filled:filled + take] = view[:take]
                filled, view = filled + take, view[take:]
                if filled == _DIRECT_BUFFER:
                    flush(index, filled, position)
                    index, filled, position = 1 - index, 0, position + _DIRECT_BUFFER
        if filled:
            flush(index, filled, position)
        wait()
        os.ftruncate(fd, size)
        fsync_fd(fd, path)
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:  # a real failure (disk full, I/O error): report it
            raise
        _NO_DIRECT.add(device)  # the filesystem accepted the flag but not the writes
        return False
    finally:
        if pending:
            pending[0].join()
        for view in views:
            view.release()
        for buffer in buffers:
            buffer.close()
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, position: int) -> int:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], position + done)
    return done


def write_bytes(path: str, data: bytes) -> tuple[int, str]:
    """Write ``data`` to ``path`` and fsync it; returns (size, checksum)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        fsync_fd(f.fileno(), path)
    summer = BlockSummer()
    summer.update(data)
    return len(data), summer.digest()
