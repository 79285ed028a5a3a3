"""What ``prepare`` handed out, and which object it turned into which, in one registry.

The Accelerator keeps its prepared models, optimizers, schedulers and dataloaders (and the objects
registered for checkpointing) here, in the order they were prepared: a checkpoint saves them in
that order. Strategies never write here; they return what they built (``Built``) and the
Accelerator records it.

``original or prepared object -> prepared object`` makes ``prepare`` idempotent. A bare ``id()``
is not an identity: once an object is freed, a new one (a DataLoader made in the next iteration of
a loop) may get the same id. Entries hold a weak reference to the object they describe and count
only while that reference still points at the very same object; the entry disappears with the
object. Objects that cannot be weakly referenced are held strongly (their id then cannot be
reused while the entry exists).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional

#: The lists of the registry, by the name a strategy gives in ``Built.kind``.
KINDS = ("models", "optimizers", "schedulers", "dataloaders", "custom_objects")


class Built(NamedTuple):
    """What a strategy built itself during ``prepare``, for the Accelerator to record.

    ``kind`` names the registry list ``value`` joins ("models", "optimizers", ...); None hands the
    value back to the caller without recording it (e.g. a scheduler the strategy's engine steps).
    """

    original: Any
    value: Any
    kind: Optional[str]


class PrepareCall(NamedTuple):
    """One ``Accelerator.prepare`` call as a strategy's ``prepare`` step sees it (read-only).

    ``items``: (argument position, object, device_placement) of each object of the call not
    prepared before; ``one_by_one(obj, device_placement, evaluation_mode=False)`` prepares one
    model, dataloader or optimizer the usual way (the Accelerator records it; an object it cannot
    prepare comes back as it was); ``dataloaders``: the Accelerator's prepared dataloaders, which
    grows as this call's are prepared; ``accumulation_steps``: the run's gradient accumulation steps.
    """

    items: list[tuple[int, Any, Optional[bool]]]
    one_by_one: Callable[..., Any]
    dataloaders: list[Any]
    accumulation_steps: int


class PreparedObjects:
    """The prepared objects in order of preparation, and ``original -> prepared`` by identity."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Callable[[], Any], Any]] = {}
        self.models: list[Any] = []
        self.optimizers: list[Any] = []
        self.schedulers: list[Any] = []
        self.dataloaders: list[Any] = []
        self.custom_objects: list[Any] = []

    def get(self, obj: Any) -> Optional[Any]:
        """The prepared object for ``obj`` (``obj`` itself when it is one), or None."""
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def add(self, original: Any, prepared: Any, kind: Optional[str] = None) -> Any:
        """Remember that ``original`` was prepared into ``prepared`` and append ``prepared`` to the
        list ``kind`` (one of ``KINDS``; None: remembered only); returns ``prepared``."""
        if kind is not None:
            getattr(self, _checked(kind)).append(prepared)
            if kind != "custom_objects":
                _mark_prepared(prepared)
        for obj in (original, prepared):
            self._entries[id(obj)] = (self._reference(obj), prepared)
        return prepared

    def record(self, built: Built) -> Any:
        """Record what a strategy built (``Built``); returns the value to hand back."""
        if built.kind is None:
            return built.value
        return self.add(built.original, built.value, built.kind)

    def clear(self) -> None:
        """Forget every prepared object (the registered custom objects stay: the user registered them)."""
        self._entries.clear()
        self.models, self.optimizers, self.schedulers, self.dataloaders = [], [], [], []

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
        # The lists travel with a copied Accelerator; weak references do not pickle, so a copy
        # prepares again what it is given.
        return {kind: getattr(self, kind) for kind in KINDS}

    def __setstate__(self, state: dict) -> None:
        self._entries = {}
        for kind in KINDS:
            setattr(self, kind, list(state.get(kind, [])))


def _mark_prepared(obj: Any) -> None:
    """Set ``_is_hasten_prepared = True`` on a prepared object, as Accelerate sets its
    ``_is_accelerate_prepared``: user code checks the flag (hasten itself goes by the registry)."""
    try:
        obj._is_hasten_prepared = True
    except (AttributeError, TypeError):  # slots, or a read-only object: the registry still knows it
        pass


def _checked(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kind of prepared object {kind!r}; one of {', '.join(KINDS)}")
    return kind
