"""Reading checkpoint files back: a mapped file, its verification against the manifest, zero-copy
views of a safetensors file whose header is checked before any view is made, and reads that go to a
GPU through two alternating host buffers. The writing side and the checksum are in ``fileio.py``.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from .fileio import _CHUNK, _CODES, _DIRECT_MIN, _MADV_POPULATE_READ, CheckpointCorruptError, checksum_buffer


class MappedFile:
    """A checkpoint file mapped into memory (read-only use; private mapping so torch can wrap it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: Optional[int] = None
        self.size = os.path.getsize(path)
        if self.size:
            with open(path, "rb") as f:
                self._map: Optional[mmap.mmap] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self.raw = torch.frombuffer(self._map, dtype=torch.uint8)
        else:
            self._map = None
            self.raw = torch.empty(0, dtype=torch.uint8)

    def checksum(self, pool: Optional[ThreadPoolExecutor] = None) -> str:
        if self.size >= _DIRECT_MIN and hasattr(os, "posix_fadvise"):
            # from the disk: ask for the whole file at once (large reads at disk speed) instead of
            # page faults reading ahead a little at a time
            try:
                os.posix_fadvise(self.fd(), 0, 0, os.POSIX_FADV_WILLNEED)
                if sys.platform.startswith("linux") and self._map is not None:
                    self._map.madvise(_MADV_POPULATE_READ)  # map every page in one call, not a fault each
            except (OSError, ValueError):  # older kernels: the page faults do it
                pass
        return checksum_buffer(self.raw, pool)

    def copy_into(self, dest: torch.Tensor, source: torch.Tensor, bounce: Optional["Bounce"] = None) -> None:
        """``dest.copy_(source)`` for a ``source`` that views this mapping, read with ``pread``
        instead when ``dest`` is a plain contiguous tensor of the same dtype and size: on the
        machines we measured, copying out of a file mapping ran at a third of the speed of reading
        the same bytes (a page fault per 4 KiB page). CUDA destinations are read through ``bounce``.
        """
        start = source.data_ptr() - self.raw.data_ptr() if self.size else -1
        nbytes = source.numel() * source.element_size()
        direct = (0 <= start and start + nbytes <= self.size and source.is_contiguous() and dest.is_contiguous()
                  and type(dest) in (torch.Tensor, torch.nn.Parameter) and dest.dtype == source.dtype
                  and dest.shape == source.shape and dest.device.type in ("cpu", "cuda") and nbytes > 0)
        if not direct:
            dest.copy_(source)
            return
        flat = dest.detach().view(-1).view(torch.uint8)
        if dest.device.type == "cpu":
            _pread_into(self.fd(), memoryview(flat.numpy()), start)
        else:
            (bounce or Bounce()).to_device(self.fd(), start, flat)

    def release_pages(self) -> None:
        """Drop the pages read through the mapping (e.g. by a checksum): they left the process's
        resident memory, and come back from the file if read again (nothing here writes them)."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def bytes(self) -> bytes:
        return bytes(self.raw.numpy().tobytes())


def file_checksum(path: str) -> str:
    """The checksum of the file at ``path``, as ``verify`` recomputes it (for files another library wrote)."""
    return MappedFile(path).checksum()


def _pread_into(fd: int, view: memoryview, position: int) -> None:
    view = view.cast("B") if view.format != "B" else view
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + _CHUNK]], position + done)
        if got <= 0:
            raise CheckpointCorruptError(f"a checkpoint file ended {len(view) - done} bytes early while reading it")
        done += got


class Bounce:
    """Two host buffers that file data passes through on its way to a GPU: while one is copied to
    the device (asynchronously, from pinned memory), the next piece is read into the other."""

    SIZE = 64 << 20

    def __init__(self) -> None:
        self.buffers: list = []
        self.events: list = [None, None]
        self.turn = 0

    def to_device(self, fd: int, position: int, dest: torch.Tensor) -> None:
        """Read ``dest.numel()`` bytes at ``position`` of ``fd`` into the flat uint8 device tensor ``dest``."""
        if not self.buffers:
            from .staging import wants_pinned

            pinned = wants_pinned([dest.device.type])
            self.buffers = [torch.empty(self.SIZE, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        stream = torch.cuda.current_stream(dest.device)
        done, total = 0, dest.numel()
        while done < total:
            n = min(self.SIZE, total - done)
            i = self.turn
            if self.events[i] is not None:  # its previous copy must be finished before it is refilled
                self.events[i].synchronize()
            buffer = self.buffers[i][:n]
            _pread_into(fd, memoryview(buffer.numpy()), position + done)
            dest[done:done + n].copy_(buffer, non_blocking=buffer.is_pinned())
            self.events[i] = torch.cuda.Event()
            self.events[i].record(stream)
            done, self.turn = done + n, 1 - i


def verify(mapped: MappedFile, size: int, checksum: Optional[str], pool: Optional[ThreadPoolExecutor] = None) -> None:
    """Raise ``CheckpointCorruptError`` unless the file has the recorded size (and checksum)."""
    if mapped.size != size:
        raise CheckpointCorruptError(
            f"{mapped.path!r} has {mapped.size} bytes but the manifest records {size}: the file was truncated or "
            "replaced after the checkpoint was written"
        )
    if checksum is not None:
        found = mapped.checksum(pool)
        if found != checksum:
            raise CheckpointCorruptError(
                f"{mapped.path!r} is corrupted: checksum {found} differs from the manifest's {checksum}"
            )


def _entry_problem(entry: Any, data_size: int) -> Optional[str]:
    """What is wrong with one tensor entry of a safetensors header (None: nothing), checked before
    any view is made: dtype known, shape of non-negative ints, offsets inside the data and matching
    the shape's byte count."""
    if not isinstance(entry, dict):
        return "is not described by an object"
    dtype = _CODES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
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
    """Header and zero-copy tensor views of a mapped safetensors file."""

    def __init__(self, mapped: MappedFile) -> None:
        self.path = mapped.path
        self.mapped = mapped
        raw = mapped.raw
        if raw.numel() < 8:
            raise CheckpointCorruptError(f"{mapped.path!r} is not a safetensors file (only {raw.numel()} bytes)")
        n = int.from_bytes(bytes(raw[:8].numpy().tobytes()), "little")
        if n > raw.numel() - 8:
            raise CheckpointCorruptError(f"{mapped.path!r} is not a safetensors file (header length {n} too large)")
        try:
            header = json.loads(bytes(raw[8:8 + n].numpy().tobytes()))
        except ValueError as e:
            raise CheckpointCorruptError(f"{mapped.path!r} has an unreadable safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointCorruptError(f"{mapped.path!r} has a damaged safetensors header (not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointCorruptError(f"{mapped.path!r} has a damaged safetensors header (metadata)")
        self.metadata: dict[str, str] = metadata
        self.entries: dict[str, dict] = header
        self._data = raw[8 + n:]
        for name, entry in header.items():
            problem = _entry_problem(entry, self._data.numel())
            if problem:
                raise CheckpointCorruptError(
                    f"{mapped.path!r} has a damaged safetensors header: tensor {name!r} {problem}")

    def shapes(self) -> dict[str, tuple]:
        return {k: tuple(v["shape"]) for k, v in self.entries.items()}

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = _CODES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointCorruptError(f"{self.path!r}: tensor {name!r} has unknown dtype {entry['dtype']!r}")
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


def quiet_frombuffer() -> None:
    """torch warns about wrapping non-writable buffers; our private mappings are writable, but the
    warning also fires for zero-length ones. Silence that one message."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
