"""The bsum64 checksum of checkpoint and weights files.

The file is read as little-endian 64-bit words (the last one zero-padded), the words are summed
modulo 2**64 per 4 KiB block, and the digest is the CRC-32 of those block sums (8-byte little-endian
each). It runs at memory speed (torch reductions), detects torn or zeroed blocks, bit flips and
misplaced 4 KiB sectors; it is an integrity check, not a defence against tampering. Pieces whose
lengths are multiples of 4 KiB can be summed apart (``piece_sums``) and joined (``digest_of``), which
is how ``reading`` sums a file while it reads it.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy
import torch

BLOCK_WORDS = 512  # 4 KiB blocks of 8-byte words
BLOCK_BYTES = BLOCK_WORDS * 8
# Threads that checksum a big file's parts beside the caller.
HASH_THREADS = max(1, min(7, (os.cpu_count() or 2) - 1))
_MASK = (1 << 64) - 1


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
            raw = as_bytes_tensor(data)
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

    def block_sums(self) -> list:
        """The sums of every 4 KiB block so far, the open one (zero-padded) included."""
        sums = list(self.sums)
        current, in_block = self.current, self.words_in_block
        if self.carry:
            current += int.from_bytes(self.carry.ljust(8, b"\0"), "little", signed=True)
            in_block += 1
        if in_block:
            sums.append(torch.tensor([_signed(current)], dtype=torch.int64))
        return sums

    def digest(self) -> str:
        return _digest(self.block_sums())

    def digests(self, block_bytes: int) -> list[str]:
        """The bsum64 of each ``block_bytes`` piece of the stream (a multiple of 4 KiB; the last piece
        may be shorter): what ``digest`` gives for each piece summed alone."""
        if block_bytes <= 0 or block_bytes % BLOCK_BYTES:
            raise ValueError(f"a checksummed block must be a positive multiple of {BLOCK_BYTES} bytes, "
                             f"not {block_bytes}")
        sums = self.block_sums()
        data = torch.cat(sums) if sums else torch.empty(0, dtype=torch.int64)
        step = block_bytes // BLOCK_BYTES
        return [_digest([data[i:i + step]]) for i in range(0, data.numel(), step)]


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
    # NumPy, one thread: as fast as torch's reduction here, without waking torch's intra-op threads, whose
    # spinning takes the core the reading thread and the thread mapping memory in need (int64 wraps alike)
    grid = words[:blocks * BLOCK_WORDS].numpy().reshape(blocks, BLOCK_WORDS)
    out = [torch.from_numpy(numpy.add.reduce(grid, axis=1, dtype=numpy.int64))]
    if blocks * BLOCK_WORDS < n:
        out.append(words[blocks * BLOCK_WORDS:].sum().view(1))
    return out


def piece_sums(raw: torch.Tensor) -> list:
    """Block sums of a uint8 piece of a file; every piece but the file's last must be a whole number
    of 4 KiB blocks (the last one's tail words are summed zero-padded, as the digest defines)."""
    size = raw.numel()
    full = size // 8 * 8
    words = raw[:full].view(torch.int64) if full else torch.empty(0, dtype=torch.int64)
    if full and raw.data_ptr() % 8:
        words = raw[:full].clone().view(torch.int64)
    sums = _block_sums(words) if full else []
    if full < size:
        value = int.from_bytes(bytes(raw[full:].numpy().tobytes()).ljust(8, b"\0"), "little", signed=True)
        if words.numel() % BLOCK_WORDS:
            last = sums[-1]
            sums[-1] = torch.cat([last[:-1], torch.tensor([_signed(int(last[-1]) + value)], dtype=torch.int64)])
        else:
            sums.append(torch.tensor([value], dtype=torch.int64))
    return sums


def digest_of(pieces: list) -> str:
    """The digest of a file from the ``piece_sums`` of its pieces, in order."""
    return _digest([s for sums in pieces for s in sums])


def checksum_buffer(raw: torch.Tensor, pool: Optional[ThreadPoolExecutor] = None) -> str:
    """bsum64 of a uint8 tensor, split over ``pool``'s threads (>= 8 MiB a part: the sums are
    memory-bound and release the GIL)."""
    blocks = -(-raw.numel() // BLOCK_BYTES)
    parts = min(HASH_THREADS + 1, blocks // 2048) if pool is not None else 1
    if parts < 2:
        return digest_of([piece_sums(raw)])
    step = (blocks // parts) * BLOCK_BYTES
    cuts = [i * step for i in range(parts)] + [raw.numel()]
    futures = [pool.submit(piece_sums, raw[cuts[i]:cuts[i + 1]]) for i in range(1, parts)]
    first = piece_sums(raw[:cuts[1]])
    return digest_of([first] + [f.result() for f in futures])


def as_bytes_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 tensor (no copy)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.dtype in (torch.complex64,):
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


