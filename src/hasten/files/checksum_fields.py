"""The checksum fields of a ``save_model`` safetensors header, in one place: the whole-file checksum
(``CHECKSUM_KEY``), the header's own (``HEADER_CHECKSUM_KEY``) and the block checksums of the data
(``BLOCK_SIZE_KEY``, ``BLOCK_CHECKSUMS_KEY``); how a reader finds them (``checksum_field``) and how the
writer fills them (``block_metadata``, ``seal_header``). Torch-free at import (``files.weights`` and
``saving`` take the names from here); the summing imports torch when used.

A checksum field holds ``bsum64:`` and 8 hex digits. While a checksum is computed, the fields it does
not cover hold ``UNSET_CHECKSUM`` (same length), so every other byte is covered: the whole-file checksum
covers the header (with the header checksum filled in), the header checksum covers the header with both
unset. The block checksums (each block's 8 hex digits, concatenated) are part of the header.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from .errors import CheckpointCorruptError

CHECKSUM_KEY = "hasten_checksum"
CHECKSUMS_KEY = "hasten_checksums"
HEADER_CHECKSUM_KEY = "hasten_header_checksum"
BLOCK_SIZE_KEY = "hasten_block_size"
BLOCK_CHECKSUMS_KEY = "hasten_block_checksums"
UNSET_CHECKSUM = "bsum64:????????"
_FIELDS = {key: re.compile(b'"' + key.encode("ascii") + rb'"\s*:\s*"([^"]*)"') for key in (CHECKSUM_KEY, HEADER_CHECKSUM_KEY)}
_CHECKSUM_VALUE = re.compile(rb'"(bsum64:[0-9a-f?]{8})"')  # the whole-file field again, should its name be damaged


def checksum_field(head: bytes, path: str, key: str = CHECKSUM_KEY) -> Optional[tuple[int, str]]:
    """(byte offset, value) of the checksum field ``key`` in the header bytes ``head`` of ``path``; None
    when it has none (a file written by another library or an older hasten)."""
    found = list(_FIELDS[key].finditer(head))
    if not found and key == CHECKSUM_KEY:
        # A flipped bit in the field's name must not make the file look like one without checksum: a value of
        # the checksum's form is still there, and it is checked (and fails, as the name differs). (A damaged
        # header-checksum name leaves the whole-file checksum, which the file is then read whole to check.)
        found = list(_CHECKSUM_VALUE.finditer(head))
    if not found:
        return None
    value = found[0].group(1).decode("ascii", "replace")
    if len(found) > 1 or not re.fullmatch(r"bsum64:[0-9a-f?]{8}", value):
        raise CheckpointCorruptError(f"{path!r} has a damaged checksum field in its header ({key}={value!r}); the "
                                     "file was damaged or edited: save it again")
    return found[0].start(1), value


def header_digest(head: bytes, spans: Sequence[int]) -> str:
    """The bsum64 of the header bytes ``head`` with the checksum fields at ``spans`` unset."""
    import torch

    from .checksum import digest_of, piece_sums

    patched = bytearray(head)
    for position in spans:
        patched[position:position + len(UNSET_CHECKSUM)] = UNSET_CHECKSUM.encode("ascii")
    return digest_of([piece_sums(torch.frombuffer(patched, dtype=torch.uint8))])


def block_metadata(pieces: Sequence[Any], block_size: int) -> dict[str, str]:
    """The metadata entries that make a file readable in verified parts: the checksum of every
    ``block_size`` bytes of its data section (``pieces``: the data's bytes in order, uint8 tensors)
    and a placeholder for the header's own checksum (``seal_header`` fills it in)."""
    from .checksum import BlockSummer

    summer = BlockSummer()
    for piece in pieces:
        summer.update(piece)
    digests = summer.digests(block_size) if any(p.numel() for p in pieces) else []
    return {BLOCK_SIZE_KEY: str(block_size), BLOCK_CHECKSUMS_KEY: "".join(d[len("bsum64:"):] for d in digests),
            HEADER_CHECKSUM_KEY: UNSET_CHECKSUM}


def seal_header(head: bytes, path: str) -> bytes:
    """``head`` (the length prefix and JSON of a header holding ``block_metadata``'s entries) with its
    own checksum filled in; the whole-file checksum, when there is one, stays as it is (unset)."""
    header = checksum_field(head, path, HEADER_CHECKSUM_KEY)
    if header is None:
        raise RuntimeError(f"{path!r}: the header checksum field was not written")
    whole = checksum_field(head, path)
    digest = header_digest(head, [header[0]] + ([whole[0]] if whole is not None else []))
    return head[:header[0]] + digest.encode("ascii") + head[header[0] + len(digest):]
