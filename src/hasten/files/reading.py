"""Reading a file so that the bytes verified are the bytes loaded.

``ReadFile`` opens a file once (``paths.open_inside``: inside its folder, no link, a plain file),
takes its size from that descriptor, and reads it once with ``pread`` into private anonymous memory
(a uint8 tensor). A checksum is computed on each piece right after it is read, on a pool thread,
while the next piece is read (both release the GIL), so verifying costs about what reading costs.
Everything downstream (``SafetensorsView``, copies into live tensors) uses these private bytes and
never the path again: a file replaced, swapped for a link, or rewritten in place during or after
the read cannot change what is loaded (a change during the read fails the checksum).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from .checksum import BLOCK_BYTES, HASH_THREADS, digest_of, piece_sums
from .errors import CheckpointCorruptError
from .paths import open_inside, split

# Read, mapped in and summed in pieces of 8 MiB (a multiple of the checksum's 4 KiB blocks: pieces are
# summed apart); of the sizes we measured (1, 2, 8 MiB), the largest overlapped the three best.
PIECE = 8 << 20
_POOLS: dict = {}
_POOL_LOCK = threading.Lock()


def _executor(name: str, threads: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if name not in _POOLS:
            _POOLS[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"hasten-{name}")
        return _POOLS[name]


def _forget_threads() -> None:
    """In a forked child the executors' threads do not exist: work queued to them would wait forever."""
    global _POOL_LOCK
    _POOLS.clear()
    _POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads)


def _pool() -> ThreadPoolExecutor:
    """The threads that sum pieces beside the reading thread."""
    return _executor("checksum", HASH_THREADS)


def _faulter() -> ThreadPoolExecutor:
    """The thread that maps memory in ahead of the reads (its own: behind the sums it would fall behind)."""
    return _executor("prefault", 1)


def pread_into(fd: int, view: memoryview, position: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``position``; a file ending early is a damaged file."""
    view = view.cast("B") if view.format != "B" else view
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], position + done)
        if got <= 0:
            raise CheckpointCorruptError(f"{path!r} ended {len(view) - done} bytes early while it was read (truncated "
                                         "or rewritten during the load)")
        done += got


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_MADVISE: list = []


def _madvise() -> Any:
    """libc's ``madvise`` through ctypes, which lets go of the GIL for the call (``mmap.madvise`` keeps it:
    the thread mapping memory in then stopped the reading and summing threads, and ran no faster than
    mapping in from the reading thread itself); None where there is none."""
    if not _MADVISE:
        function = None
        try:
            function = ctypes.CDLL(None, use_errno=True).madvise
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
        except (OSError, AttributeError):
            function = None
        _MADVISE.append(function)
    return _MADVISE[0]


class PrivateMemory:
    """``size`` bytes of anonymous memory of this process alone (``tensor``: a uint8 tensor that keeps
    them). On the machines we measured, touching fresh memory for the first time cost more than reading
    the file into it (a page fault per 4 KiB page), so ``prefault`` maps a range in ahead of the read, on
    a thread of its own, while the range before it is read and summed. (Huge pages were faster on average
    but erratic on a VM, up to 20 times slower when the kernel had just given its huge pages back.)"""

    def __init__(self, size: int) -> None:
        self._address = None
        if size >= PIECE and sys.platform.startswith("linux") and _madvise() is not None:
            memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping; unmapped with it
            self._address = self.tensor.data_ptr()
        else:
            self.tensor = torch.empty(size, dtype=torch.uint8)

    def prefault(self, start: int, length: int) -> None:
        if self._address is not None and length > 0 and start + length <= self.tensor.numel():
            if _madvise()(self._address + start, length, _MADV_POPULATE_WRITE) != 0:
                self._address = None  # older kernels (EINVAL): the read's own page faults do it


def pread_tensor(fd: int, nbytes: int, position: int, path: str) -> torch.Tensor:
    """``nbytes`` of ``fd`` at ``position`` as a new uint8 tensor."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        pread_into(fd, memoryview(out.numpy()), position, path)
    return out


class ReadFile:
    """A file's bytes read once into private memory (``raw``), optionally verified while read.

    ``checksum``: the expected bsum64, True (sum only: ``found``), or a callable given the first bytes (a whole header at least,
    see ``head``) that returns it (None: nothing recorded) after patching them in place, and that is
    called again with None once summed, to undo the patch (``save_model``'s self checksum)."""

    def __init__(self, fd: int, path: str, size: Optional[int] = None, checksum: Any = None,
                 head: Callable[[bytes], int] = lambda first: 0, pool: Optional[ThreadPoolExecutor] = None) -> None:
        self.path = path
        self.found: Optional[str] = None
        try:
            self.size = os.fstat(fd).st_size
            if size is not None and self.size != size:
                raise CheckpointCorruptError(
                    f"{path!r} has {self.size} bytes but the manifest records {size}: the file was truncated or "
                    "replaced after the checkpoint was written")
            self.memory = PrivateMemory(self.size)
            self.raw = self.memory.tensor
            self.recorded = self._read(fd, checksum, head, pool or _pool())
        finally:
            os.close(fd)

    def _read(self, fd: int, checksum: Any, head: Callable[[bytes], int], pool: ThreadPoolExecutor) -> Optional[str]:
        size, raw = self.size, self.raw
        view = memoryview(raw.numpy()) if size else memoryview(b"")
        if size >= PIECE and hasattr(os, "posix_fadvise"):
            try:  # from the disk: read ahead in large requests
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass
        done = 0
        expected = checksum
        if callable(checksum):  # the header first: the checksum is found (and patched) there
            done = min(size, PIECE)
            pread_into(fd, view[:done], 0, self.path)
            need = head(bytes(view[:min(done, 8)]))
            if need > done:
                done = min(size, -(-need // BLOCK_BYTES) * BLOCK_BYTES)
                pread_into(fd, view[PIECE:done], PIECE, self.path)
            expected = checksum(raw[:done])
        futures = []
        summing = expected is not None
        if summing and done:
            futures.append(pool.submit(piece_sums, raw[:done]))
        faulter = _faulter()
        faulted = faulter.submit(self.memory.prefault, done, PIECE)
        while done < size:
            n = min(PIECE, size - done)
            faulted.result()
            faulted = faulter.submit(self.memory.prefault, done + n, min(PIECE, size - done - n))
            pread_into(fd, view[done:done + n], done, self.path)
            if summing:
                futures.append(pool.submit(piece_sums, raw[done:done + n]))
            done += n
        faulted.result()
        if os.fstat(fd).st_size != size:
            raise CheckpointCorruptError(f"{self.path!r} changed size while it was read (rewritten during the load)")
        if not summing:
            return None
        found = digest_of([f.result() for f in futures]) if futures else digest_of([piece_sums(raw)])
        if callable(checksum):
            checksum(None)
        self.found = found
        if expected is not True and found != expected:
            raise CheckpointCorruptError(
                f"{self.path!r} is corrupted: checksum {found} differs from the {expected} recorded for it "
                "(a flipped bit, an edited file, or one rewritten while it was read)")
        return None if expected is True else expected

    def bytes(self) -> bytes:
        return bytes(self.raw.numpy().tobytes())

    def close(self) -> None:
        """Let go of the private bytes (views taken from them keep their part alive)."""
        self.raw = torch.empty(0, dtype=torch.uint8)
        self.memory = None


def read_inside(folder: str, name: str, size: Optional[int] = None, checksum: Any = None,
                what: str = "checkpoint file", **kwargs: Any) -> ReadFile:
    """``ReadFile`` of ``name`` inside ``folder`` (``paths.open_inside``), checked against ``size`` and ``checksum``."""
    return ReadFile(open_inside(folder, name, what), os.path.join(folder, name), size, checksum, **kwargs)


def read_path(path: str, checksum: Any = None, what: str = "file", **kwargs: Any) -> ReadFile:
    """``ReadFile`` of a path a caller gave (its folder may be reached through links, the file may not)."""
    folder, name = split(path)
    return ReadFile(open_inside(folder, name, what, nested=False), path, None, checksum, **kwargs)


def file_checksum(path: str) -> str:
    """The bsum64 of the plain file at ``path`` (for files another library wrote)."""
    return ReadFile(open_inside(*split(path), "file", nested=False), path, None, True).found or ""
