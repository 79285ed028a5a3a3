"""Which object ``prepare`` turned into which, without ever confusing two objects.

A bare ``id()`` is not an identity: once an object is freed, a new one (a DataLoader made in the
next iteration of a loop) may get the same id. Entries here hold a weak reference to the object
they describe and count only while that reference still points at the very same object; the
entry disappears with the object. Objects that cannot be weakly referenced are held strongly
(their id then cannot be reused while the entry exists).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional


class PreparedObjects:
    """``original or prepared object -> prepared object``, by identity (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Callable[[], Any], Any]] = {}

    def get(self, obj: Any) -> Optional[Any]:
        """The prepared object for ``obj`` (``obj`` itself when it is one), or None."""
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def add(self, original: Any, prepared: Any) -> Any:
        """Remember that ``original`` was prepared into ``prepared``; returns ``prepared``."""
        for obj in (original, prepared):
            self._entries[id(obj)] = (self._reference(obj), prepared)
        return prepared

    def clear(self) -> None:
        self._entries.clear()

    def _reference(self, obj: Any) -> Callable[[], Any]:
        key = id(obj)
        owner = weakref.ref(self)

        def forget(ref: Any) -> None:  # the object is gone: its id may be reused from now on
            table = owner()._entries if owner() is not None else {}
            if table.get(key, (None,))[0] is ref:
                del table[key]

        try:
            return weakref.ref(obj, forget)
        except TypeError:  # not weakly referenceable: keep it alive so that its id stays its own
            return lambda: obj

    def __getstate__(self) -> dict:
        # Weak references do not pickle; a copied Accelerator prepares again what it is given.
        return {}

    def __setstate__(self, state: dict) -> None:
        self._entries = {}
