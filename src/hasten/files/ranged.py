"""Reading only the parts of a safetensors weights file that a process holds, verified.

``RangedWeights`` opens a weights file once (``weights.open_weights``: a plain file, no link, nothing
outside its folder), reads its header and checks it (``safetensors_format.header_length`` /
``parse_header``), then reads with ``pread`` on that one descriptor only the byte ranges asked for
(``blocks``): for a block of a tensor, the smallest contiguous range of its bytes that covers the
block. A file replaced at its path after it was opened is never read: every range comes from the
file whose header was checked.

What is verified depends on what the file records:

* ``save_model``'s files (``saving.write_weights_into``) record, beside the checksum of their whole
  bytes (``CHECKSUM_KEY``, for readers of the whole file), the bsum64 of the header itself
  (``HEADER_CHECKSUM_KEY``, computed with that value and the whole-file one set to ``UNSET_CHECKSUM``)
  and the bsum64 of every ``BLOCK_SIZE_KEY``-byte block of the data section (``BLOCK_CHECKSUMS_KEY``:
  each block's 8 hex digits, concatenated). The header is verified before it is parsed, and a range is
  widened to whole blocks, each verified once read: a difference is a ``CheckpointCorruptError``
  naming the file and the block.
* A file that records a whole-file checksum but no block checksums (an older hasten) cannot be
  verified in parts: ``whole_only`` is True and the caller reads it whole (``weights.read_weights``).
* A file that records no checksum (``safetensors.torch.save_file``, transformers' ``save_pretrained``)
  gets the header checks only; its ranges are read as they are.

The fields and the writer's side are in ``checksum_fields`` (``block_metadata``, ``seal_header``).
``BLOCK_SIZE`` is the block size ``save_model`` writes (1 MiB); it is read when a file is written, so
a test may set a smaller one (a multiple of 4 KiB) to have blocks smaller than a tensor.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Sequence

import torch

from .checksum import digest_of, piece_sums
from .checksum_fields import (BLOCK_CHECKSUMS_KEY, BLOCK_SIZE_KEY, HEADER_CHECKSUM_KEY, checksum_field,
                              header_digest)
from .errors import CheckpointCorruptError
from .reading import pread_into, pread_tensor
from .safetensors_format import CODES, header_length, parse_header
from .weights import open_weights

BLOCK_SIZE = 1 << 20
_MAX_BLOCK = 1 << 34


# -- reading ---------------------------------------------------------------------------------------
class RangedWeights:
    """A safetensors weights file opened once, its header read and checked; ``blocks`` reads parts of
    its tensors. ``metadata``, ``entries``: the header's; ``recorded``: the whole-file checksum it
    records (None: none); ``whole_only``: it records that one only (read it whole instead);
    ``bytes_read``: what was read from the file so far. ``close`` lets go of the descriptor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: Optional[int] = open_weights(path)
        self.bytes_read = 0
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise

    def _pread(self, nbytes: int, position: int) -> torch.Tensor:
        out = pread_tensor(self.fd, nbytes, position, self.path)
        self.bytes_read += nbytes
        return out

    def _read_header(self) -> None:
        path = self.path
        self.size = os.fstat(self.fd).st_size
        first = bytes(self._pread(min(8, self.size), 0).numpy().tobytes())
        n = header_length(first, self.size, path)
        head = first + bytes(self._pread(n, 8).numpy().tobytes())
        self.data_start, data_size = 8 + n, self.size - 8 - n
        whole = checksum_field(head, path)
        header = checksum_field(head, path, HEADER_CHECKSUM_KEY)
        self.recorded = whole[1] if whole is not None else None
        self.whole_only = whole is not None and header is None
        self.block_size, self.checksums = 0, ""
        if header is not None:
            if whole is not None and whole[0] == header[0]:  # only the header's value is left: a damaged name
                raise CheckpointCorruptError(f"{path!r} has a damaged checksum field in its header; the file was "
                                             "damaged or edited: save it again")
            found = header_digest(head, [header[0]] + ([whole[0]] if whole is not None else []))
            if found != header[1]:
                raise CheckpointCorruptError(f"{path!r} is corrupted: its header has checksum {found}, not the "
                                             f"{header[1]} recorded when it was saved (a flipped bit or an edited "
                                             "file); save the weights again")
        self.metadata, self.entries = parse_header(head[8:], data_size, path)
        if header is not None:
            self._block_checksums(data_size)

    def _block_checksums(self, data_size: int) -> None:
        size, sums = self.metadata.get(BLOCK_SIZE_KEY, ""), self.metadata.get(BLOCK_CHECKSUMS_KEY)
        block = int(size) if size.isdigit() else 0
        count = -(-data_size // block) if block else 0
        digits = sums is not None and len(sums) == 8 * count and re.fullmatch(r"[0-9a-f]*", sums) is not None
        if not 0 < block <= _MAX_BLOCK or not digits:
            raise CheckpointCorruptError(f"{self.path!r} has damaged block checksums in its header ({BLOCK_SIZE_KEY}="
                                         f"{size!r}, {len(sums or '')} digits for {data_size} data bytes); save the "
                                         "weights again")
        self.block_size, self.checksums = block, sums

    def shapes(self) -> dict[str, tuple]:
        return {k: tuple(v["shape"]) for k, v in self.entries.items()}

    def _span(self, key: str, index: tuple) -> Optional[tuple[int, int, list, list, torch.dtype]]:
        """(start, end) of the bytes of ``key``'s block ``index`` in the data section, its shape, the
        tensor's strides and dtype; None for an empty block."""
        entry = self.entries[key]
        dtype, shape = CODES[entry["dtype"]], entry["shape"]
        ranges = [range(*s.indices(n)) for s, n in zip(index, shape)] + [range(n) for n in shape[len(index):]]
        if any(r.step != 1 for r in ranges):
            raise ValueError(f"{self.path!r}: a block of {key!r} is read with steps of 1 only, not {index}")
        if any(len(r) == 0 for r in ranges):
            return None
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n
        itemsize = torch.empty((), dtype=dtype).element_size()
        first = sum(r.start * s for r, s in zip(ranges, strides))
        last = sum((r.stop - 1) * s for r, s in zip(ranges, strides))
        start = entry["data_offsets"][0] + first * itemsize
        return start, start + (last + 1 - first) * itemsize, [len(r) for r in ranges], strides, dtype

    def blocks(self, wanted: Sequence[tuple[str, tuple]]) -> list[torch.Tensor]:
        """The blocks ``wanted`` ((tensor name, tuple of slices) each) of this file's tensors, read from
        the file (each byte range once, whole checksummed blocks where the file records them) and
        verified; tensors viewing the bytes read. Raises ``CheckpointCorruptError`` naming the file."""
        spans = [self._span(key, index) for key, index in wanted]
        ranges = sorted(self._widen(s[0], s[1]) for s in spans if s is not None)
        merged: list[list[int]] = []
        for start, end in ranges:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        read = [(start, self._read(start, end)) for start, end in merged]
        if os.fstat(self.fd).st_size != self.size:
            raise CheckpointCorruptError(f"{self.path!r} changed size while it was read (rewritten during the load)")
        out = []
        for span in spans:
            if span is None:
                key, index = wanted[len(out)]
                entry = self.entries[key]
                shape = [len(range(*s.indices(n))) for s, n in zip(index, entry["shape"])] + entry["shape"][len(index):]
                out.append(torch.empty(shape, dtype=CODES[entry["dtype"]]))
                continue
            start, end, shape, strides, dtype = span
            at, raw = next((a, r) for a, r in read if a <= start and end <= a + r.numel())
            out.append(_as_tensor(raw[start - at:end - at], dtype, shape, strides))
        return out

    def _widen(self, start: int, end: int) -> tuple[int, int]:
        if not self.block_size:
            return start, end
        data_size = self.size - self.data_start
        return start // self.block_size * self.block_size, min(data_size, -(-end // self.block_size) * self.block_size)

    def _read(self, start: int, end: int) -> torch.Tensor:
        """Bytes ``start:end`` of the data section, every checksummed block in them verified."""
        raw = torch.empty(end - start, dtype=torch.uint8)
        pread_into(self.fd, memoryview(raw.numpy()), self.data_start + start, self.path)
        self.bytes_read += end - start
        block = self.block_size
        for at in range(start, end, block) if block else ():
            number = at // block
            found = digest_of([piece_sums(raw[at - start:min(end, at + block) - start])])[len("bsum64:"):]
            recorded = self.checksums[8 * number:8 * number + 8]
            if found != recorded:
                raise CheckpointCorruptError(
                    f"{self.path!r} is corrupted: block {number} (data bytes {at} to {min(end, at + block)}) has "
                    f"checksum bsum64:{found}, not the bsum64:{recorded} recorded when it was saved (a flipped bit, "
                    "an edited file, or one rewritten while it was read); save the weights again")
        return raw

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


def _as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape: list, strides: list) -> torch.Tensor:
    """The block ``shape`` (in a tensor of ``strides``) whose first element starts ``raw``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw.data_ptr() % itemsize:  # a file from another writer may leave tensors unaligned
        raw = raw.clone()
    if dtype == torch.complex64:
        flat = torch.view_as_complex(raw.view(torch.float32).view(-1, 2))
    else:
        flat = raw.view(dtype)
    return flat.as_strided(shape, strides)
