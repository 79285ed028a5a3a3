"""Which backend stores, and which reads, the models and optimizers of a checkpoint.

Saving asks the live strategy (``Strategy.checkpoint_backend()``: None for one full safetensors
file per object, else a backend). Reading asks the manifest: every backend registers the key its
model entries carry (``{"dcp": ...}``, ``{"deepspeed": ...}``) with a factory that builds it for the
live strategy, so a checkpoint is read by the backend that wrote it whatever strategy runs now (the
factory may hand back the live strategy's own backend).
A backend has ``KEY``, ``refuse``, ``entries``, ``optimizer_entry``, ``writer``, ``listing``,
``check`` and ``load`` (see ``checkpointing.sharded``); ``EXCLUSIVE = True`` when a run that
saves with it can load nothing else. A factory is called once per load, so what ``check`` read the
load can reuse (``sharded.Reader``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

_READERS: dict[str, Callable[[Any], Any]] = {}
# Backends shipped with hasten, imported on first lookup so that they register themselves.
_BUILTIN = ("hasten.checkpointing.sharded", "hasten.checkpointing.deepspeed_state")


def register(key: str, factory: Callable[[Any], Any]) -> None:
    """Read manifest model entries holding ``key`` with ``factory(live_strategy)``."""
    _READERS[key] = factory


def reader_for(contents: dict[str, Any], strategy: Any) -> Optional[Any]:
    """The backend that reads a checkpoint's models (None: full safetensors files), built by its
    registered factory for the live strategy (which may hand back the strategy's own backend, bound
    to live objects such as DeepSpeed engines)."""
    for name in _BUILTIN:
        importlib.import_module(name)
    for entry in contents["models"]:
        for key in entry:
            if key in _READERS:
                return _READERS[key](strategy)
    return None
