"""``save_model``'s weights files: the checksum each records about itself, and reading one so that the
bytes verified are the bytes loaded.

Every safetensors file ``save_model`` writes records the bsum64 of its own bytes under ``CHECKSUM_KEY``
in its header metadata, computed with that value replaced by ``UNSET_CHECKSUM`` (same length), so every
byte is covered, the header included; its index records each file's value under ``CHECKSUMS_KEY`` and
its own under ``CHECKSUM_KEY`` the same way. The files stay plain safetensors / JSON for other readers.
They also record the checksums of their header and of every block of their data (``files.checksum_fields``,
read in parts by ``files.ranged``),
so that a process of a sharded load can read and verify only its parts; the readers here read and
verify whole files.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from .checksum_fields import CHECKSUM_KEY, CHECKSUMS_KEY, UNSET_CHECKSUM, checksum_field  # noqa: F401 - public here
from .errors import CheckpointCorruptError
from .paths import hub_blob, open_inside, split

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .reading import ReadFile

# Torch-free at import (``saving`` takes the names from here): the reading side imports torch when used.
# transformers' names, which save_model writes and load_checkpoint_in_model looks for in a folder
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def self_checksum(raw: "torch.Tensor", head: int, path: str, pool: Any = None) -> Optional[str]:
    """Check the checksum a file records about itself; ``raw``: its bytes as a writable uint8 tensor
    (a private mapping), whose first ``head`` bytes hold the field. Returns the recorded value, None
    when the file records none; raises ``CheckpointCorruptError`` when the bytes differ."""
    import torch

    from .checksum import checksum_buffer

    field = checksum_field(bytes(raw[:head].numpy().tobytes()), path)
    if field is None:
        return None
    position, value = field
    span = raw[position:position + len(UNSET_CHECKSUM)]
    recorded = span.clone()
    span.copy_(torch.frombuffer(bytearray(UNSET_CHECKSUM.encode("ascii")), dtype=torch.uint8))
    try:
        found = checksum_buffer(raw, pool)
    finally:
        span.copy_(recorded)  # a private mapping: the file itself is never written
    if found != value:
        raise CheckpointCorruptError(f"{path!r} is corrupted: its bytes have checksum {found}, not the {value} recorded "
                                     "when it was saved (a flipped bit or an edited file); save the weights again")
    return value


def open_weights(path: str) -> int:
    """A descriptor of the weights file ``path``: a plain file (``paths.open_inside``), or a link
    of a Hugging Face cache snapshot to its blob (``paths.hub_blob``), opened as a plain file of ``blobs/``."""
    folder, name = hub_blob(path) or split(path)
    try:
        return open_inside(folder, name, "checkpoint file", nested=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file {path!r} does not exist; the checkpoint is incomplete") from None


class SelfChecked:
    """The checksum a ``save_model`` file records about itself, for ``files.reading.ReadFile``: found in
    the header (patched to its unset value in the private bytes while they are summed, put back
    after), then compared with the sum of every byte read."""

    def __init__(self, path: str, found: bool = False) -> None:
        self.path, self.found = path, found
        self.span: Any = None
        self.value: Any = None

    def head(self, first: bytes) -> int:
        from .safetensors_format import header_length

        self.header = 8 + header_length(first, os.fstat(self.fd).st_size, self.path)
        return self.header

    def __call__(self, raw: Any) -> Any:
        import torch

        if raw is None:  # summed: put the recorded bytes back
            if self.span is not None:
                self.span.copy_(self.value)
            return None
        field = checksum_field(bytes(raw[:self.header].numpy().tobytes()), self.path)
        if field is None:
            return True if self.found else None  # nothing recorded: summed only when asked (to compare reads)
        position, recorded = field
        self.span = raw[position:position + len(UNSET_CHECKSUM)]
        self.value = self.span.clone()
        self.span.copy_(torch.frombuffer(bytearray(UNSET_CHECKSUM.encode("ascii")), dtype=torch.uint8))
        return recorded

    @classmethod
    def read(cls, path: str, found: bool = False) -> Any:
        """``ReadFile`` of the weights file ``path``, verified while read; ``.view`` its ``SafetensorsView``.
        ``found``: sum a file that records no checksum too (``.found``), to compare it with a later read."""
        from .reading import ReadFile
        from .safetensors_format import SafetensorsView

        check = cls(path, found)
        check.fd = open_weights(path)
        file = ReadFile(check.fd, path, None, check, head=check.head)
        file.view = SafetensorsView(file)
        return file


def read_weights(path: str, found: bool = False) -> "ReadFile":
    """``SelfChecked.read``: the weights file ``path`` read once, verified; ``.view`` its tensors."""
    return SelfChecked.read(path, found)
