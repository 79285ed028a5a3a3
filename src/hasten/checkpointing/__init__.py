"""Checkpoints that never lose work: ``save_state``/``load_state``, exact resume, recovery.

``commit`` (the commit protocol, top to bottom), ``layout`` (naming, manifest file, atomic rename,
removal, retention; torch-free), ``codec`` (state
dicts without pickle), ``rng``, ``saver``/``restorer``/``loading`` (what goes in and how it comes
back), ``resume`` (positions across world sizes, ``resume="auto"``), ``preemption`` (save on
SIGTERM) and ``mixin`` (the ``Accelerator`` methods). Every file is read and written through
``hasten/files/``, whose errors are re-exported here.
"""

from ..files.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DamagedManifestError,
    IncompleteCheckpointError,
    UnsafeFileError,
)
from .mixin import CheckpointMixin

__all__ = ["CheckpointCorruptError", "CheckpointMixin", "CheckpointNotFoundError", "DamagedManifestError",
           "IncompleteCheckpointError", "UnsafeFileError"]
