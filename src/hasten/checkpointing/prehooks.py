"""The ``save_state`` / ``load_state`` pre-hooks an Accelerator holds.

``mixin`` registers them (``register_*_state_pre_hook``); ``mixin`` runs the save hooks and
``loading`` / ``accelerate_folder`` run the load hooks, each through this module.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

SAVE = "_hasten_save_state_pre_hooks"
LOAD = "_hasten_load_state_pre_hooks"


def registered(owner: Any, key: str) -> OrderedDict:
    """The hooks ``owner`` holds under ``key`` (``SAVE`` or ``LOAD``), in registration order."""
    # An OrderedDict: torch's RemovableHandle keeps a weak reference to it (plain dicts have none).
    return owner.__dict__.setdefault(key, OrderedDict())


def register(owner: Any, key: str, hook: Callable[..., None]) -> Any:
    """Add ``hook`` under ``key``; returns a handle whose ``remove()`` unregisters it."""
    from torch.utils.hooks import RemovableHandle

    hooks = registered(owner, key)
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def run(owner: Any, key: str, *args: Any) -> None:
    """Call every hook under ``key`` with ``args`` (a copy of the list: a hook may remove itself)."""
    for hook in list(registered(owner, key).values()):
        hook(*args)
