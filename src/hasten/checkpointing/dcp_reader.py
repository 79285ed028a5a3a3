"""Reading DCP checkpoints without torch's ``pickle.load``: the storage reader and load planner that
``load_state`` and ``hasten merge-weights`` hand to ``torch.distributed.checkpoint.load``.

DCP's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load`` and its
``DefaultLoadPlanner.load_bytes`` reads non-tensor values (optimizer hyperparameters) with
``torch.load(weights_only=False)``: either runs whatever code a replaced file names. Here the
metadata goes through ``unpickling.dcp_metadata`` (an allow-list of DCP's records) and the values
through ``torch.load(weights_only=True)``; tensors DCP already reads weights-only.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from . import unpickling


class MetadataReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata is read with the allow-list, or handed in already read."""

    def __init__(self, path: str, metadata: Optional[Metadata] = None) -> None:
        super().__init__(path)
        self.given = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self.given is not None:
            metadata, self.given = self.given, None  # used once: a reset reader reads the file again
        else:  # the global file, or a rank-local one (DCP's fallback when the global one is missing)
            metadata = unpickling.dcp_metadata(os.path.join(self.path, ".metadata" if rank is None
                                                            else f"__{rank}.metadata"))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values weights-only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            why = next((line for line in lines if "WeightsUnpickler error" in line), lines[-1] if lines else "")
            why = why.split(". Please")[0]  # torch's advice (allow the global process-wide) does not apply here
            raise unpickling.ForbiddenPickle(
                f"the checkpoint value {read_item.dest_index.fqn!r} holds more than tensors and plain Python values, "
                f"which a checkpoint save never stores, so it was tampered with; hasten refused to unpickle it and "
                f"nothing in it ran ({why})") from None
        # The parent stores the value where it belongs; it is given a pickle of what was just read safely.
        safe = io.BytesIO()
        torch.save(loaded, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)
