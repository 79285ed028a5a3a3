"""The exceptions of checkpoint and model files (torch-free). Re-exported by ``checkpointing``."""

from __future__ import annotations


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint where one was expected."""


class IncompleteCheckpointError(ValueError):
    """A folder that is not a complete hasten checkpoint of a version this hasten reads."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file (the manifest included) does not have the size or checksum recorded for it."""


class DamagedManifestError(CheckpointCorruptError, IncompleteCheckpointError):
    """``manifest.json`` itself is damaged (unparseable, or its own checksum does not match): both a
    corrupt file and an incomplete checkpoint, so callers catching either see it."""


class UnsafeFileError(CheckpointCorruptError, IncompleteCheckpointError):
    """A name that leaves its folder, a symbolic link, or something other than a plain file where a
    file of a checkpoint (or of saved weights) should be. Nothing was read from it."""
