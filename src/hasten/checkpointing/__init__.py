"""Checkpoints that never lose work: ``save_state``/``load_state``, exact resume, recovery.

``commit`` (the commit protocol, top to bottom), ``layout`` (naming, manifest file, atomic rename,
removal, retention; torch-free), ``fileio`` (safetensors files with checksums), ``codec`` (state
dicts without pickle), ``rng``, ``saver``/``restorer``/``loading`` (what goes in and how it comes
back), ``resume`` (positions across world sizes, ``resume="auto"``), ``preemption`` (save on
SIGTERM) and ``mixin`` (the ``Accelerator`` methods).
"""

from .layout import CheckpointNotFoundError, IncompleteCheckpointError
from .mixin import CheckpointMixin

__all__ = ["CheckpointMixin", "CheckpointNotFoundError", "IncompleteCheckpointError"]
