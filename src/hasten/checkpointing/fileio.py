"""Checkpoint files: safetensors written without extra copies, fsynced, with a fast checksum.

Every file of a checkpoint is a safetensors file (tensors plus a JSON "skeleton" in the header
metadata, see ``codec.py``), so nothing in a checkpoint is unpickled by default. We write the
format ourselves instead of calling ``safetensors.torch.save_file`` because that function first
copies every tensor into a ``bytes`` object, and because big files are written past the page
cache (O_DIRECT), which makes a durable save about as fast as the disk. The files are plain
safetensors (tests read them with the safetensors library) with tensors ordered by decreasing item
size, so every tensor is aligned for its dtype.

Checksum ("bsum64"): the file is read as little-endian 64-bit words (the last one zero-padded), the
words are summed modulo 2**64 per 4 KiB block, and the digest is the CRC-32 of those block sums
(8-byte little-endian each). It runs at memory speed (torch reductions), detects torn or zeroed
blocks, bit flips and misplaced 4 KiB sectors; it is an integrity check, not a defence against
tampering.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch


BLOCK_WORDS = 512  # 4 KiB blocks of 8-byte words
# Threads that checksum a big file's parts beside the caller (the pool ``load_state`` passes has this many).
HASH_THREADS = max(1, min(7, (os.cpu_count() or 2) - 1))
_MASK = (1 << 64) - 1

# safetensors dtype codes
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


from .layout import CheckpointCorruptError  # noqa: E402,F401 - defined torch-free, raised here


# -- checksum -----------------------------------------------------------------------------------------
class BlockSummer:
    """Incremental bsum64 over a stream of byte pieces written one after the other."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []  # int64 sums of finished blocks (wrapping = modulo 2**64)
        self.current = 0  # sum of the words of the open block
        self.words_in_block = 0
        self.carry = b""  # bytes of a word not yet complete

    def update(self, data: Any) -> None:
        """Add ``data``: bytes, or a CPU tensor (its memory is read in place)."""
        if isinstance(data, torch.Tensor):
            raw = _as_bytes_tensor(data)
        else:
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        if self.carry:
            need = 8 - len(self.carry)
            self.carry += bytes(raw[:need].numpy().tobytes())
            raw = raw[need:]
            if len(self.carry) < 8:
                return
            self._add_words(torch.frombuffer(bytearray(self.carry), dtype=torch.int64))
            self.carry = b""
        full = raw.numel() // 8 * 8
        if full:
            body = raw[:full]
            if body.data_ptr() % 8:  # unaligned memory: an int64 view needs aligned storage
                body = body.clone()
            self._add_words(body.view(torch.int64))
        if full < raw.numel():
            self.carry = bytes(raw[full:].numpy().tobytes())

    def _close_block(self) -> None:
        self.sums.append(torch.tensor([_signed(self.current)], dtype=torch.int64))
        self.current, self.words_in_block = 0, 0

    def _add_words(self, words: torch.Tensor) -> None:
        n = words.numel()
        pos = 0
        if self.words_in_block:
            take = min(n, BLOCK_WORDS - self.words_in_block)
            self.current += int(words[:take].sum())
            self.words_in_block += take
            pos = take
            if self.words_in_block == BLOCK_WORDS:
                self._close_block()
        blocks = (n - pos) // BLOCK_WORDS
        if blocks:
            end = pos + blocks * BLOCK_WORDS
            self.sums.append(words[pos:end].view(blocks, BLOCK_WORDS).sum(1))
            pos = end
        if pos < n:
            self.current += int(words[pos:].sum())
            self.words_in_block += n - pos

    def digest(self) -> str:
        sums = list(self.sums)
        current, in_block = self.current, self.words_in_block
        if self.carry:
            current += int.from_bytes(self.carry.ljust(8, b"\0"), "little", signed=True)
            in_block += 1
        if in_block:
            sums.append(torch.tensor([_signed(current)], dtype=torch.int64))
        return _digest(sums)


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _digest(sums: list) -> str:
    """CRC-32 of the block sums as 8-byte little-endian words."""
    data = torch.cat(sums) if sums else torch.empty(0, dtype=torch.int64)
    crc = zlib.crc32(data.numpy().astype("<i8", copy=False).tobytes())
    return f"bsum64:{crc:08x}"


def _block_sums(words: torch.Tensor) -> list:
    n = words.numel()
    blocks = n // BLOCK_WORDS
    out = [words[:blocks * BLOCK_WORDS].view(blocks, BLOCK_WORDS).sum(1)]
    if blocks * BLOCK_WORDS < n:
        out.append(words[blocks * BLOCK_WORDS:].sum().view(1))
    return out


def checksum_buffer(raw: torch.Tensor, pool: Optional[ThreadPoolExecutor] = None) -> str:
    """bsum64 of a uint8 tensor (e.g. a memory-mapped file), split over ``pool``'s threads."""
    size = raw.numel()
    full = size // 8 * 8
    words = raw[:full].view(torch.int64) if full else torch.empty(0, dtype=torch.int64)
    tail = bytes(raw[full:].numpy().tobytes())
    nblocks = -(-words.numel() // BLOCK_WORDS)
    # >= 8 MiB a part: worth another thread (the sums are memory-bound and release the GIL)
    parts = min(HASH_THREADS + 1, nblocks // 2048) if pool is not None else 1
    if parts >= 2:
        step = (nblocks // parts) * BLOCK_WORDS
        cuts = [i * step for i in range(parts)] + [words.numel()]
        futures = [pool.submit(_block_sums, words[cuts[i]:cuts[i + 1]]) for i in range(1, parts)]
        sums = _block_sums(words[:cuts[1]])
        for future in futures:
            sums += future.result()
    else:
        sums = _block_sums(words)
    if tail:
        value = int.from_bytes(tail.ljust(8, b"\0"), "little", signed=True)
        if words.numel() % BLOCK_WORDS:
            last = sums[-1]
            sums[-1] = torch.cat([last[:-1], torch.tensor([_signed(int(last[-1]) + value)], dtype=torch.int64)])
        else:
            sums.append(torch.tensor([value], dtype=torch.int64))
    return _digest(sums)


def _as_bytes_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 tensor (no copy)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.dtype in (torch.complex64,):
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


# -- writing ---------------------------------------------------------------------------------------
def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


_CHUNK = 64 << 20
_MADV_POPULATE_READ = 22  # Linux >= 5.14
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


def _fsync(fd: int, path: str) -> None:
    """fsync a file just written; an I/O error fails the save (see ``saving.fsync_fd``)."""
    from ..saving import fsync_fd

    fsync_fd(fd, path)


def write_safetensors(path: str, tensors: dict[str, torch.Tensor],
                      metadata: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """Write ``tensors`` as a safetensors file at ``path``, fsync it; returns (size, checksum).

    Tensors must not share memory (the caller drops tied duplicates). The checksum runs inline, at
    memory speed: computed on a second thread beside the writes it made saves slower and less steady
    on a 2-core machine (it competes with the kernel's writeback).
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    prepared = {k: _cpu_contiguous(tensors[k]) for k in order}
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        t = prepared[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot store tensor {name!r} of dtype {t.dtype} in a checkpoint; convert it first")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)  # data starts 8-aligned
    head = len(text).to_bytes(8, "little") + text
    pieces = [head] + [raw for raw in (_as_bytes_tensor(prepared[name]) for name in order) if raw.numel()]
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
        _fsync(f.fileno(), path)


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
        _fsync(fd, path)
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
        _fsync(f.fileno(), path)
    summer = BlockSummer()
    summer.update(data)
    return len(data), summer.digest()
