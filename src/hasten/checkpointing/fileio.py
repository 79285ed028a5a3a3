"""Former home of checkpoint file writing and checksums, kept so that ``hasten.checkpointing.fileio``
imports written against earlier versions (and docs) keep working. The code is in ``hasten/files/``:
``errors``, ``checksum`` and ``safetensors_format``."""

from ..files.checksum import BlockSummer, checksum_buffer  # noqa: F401
from ..files.errors import CheckpointCorruptError  # noqa: F401
from ..files.safetensors_format import write_safetensors  # noqa: F401
