"""The base class of the ``kwargs_handlers`` objects, kept apart so that both the configuration
objects (``dataclasses``) and the fp8 recipes (``fp8_recipes``) can build on it."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

# Prefixes of the variables from which fields left unset take their value (as Accelerate, a value
# that came from the environment differs from the default, so to_kwargs reports it).
_SETTING_PREFIXES = ("HASTEN_", "ACCELERATE_")


def _default_without_environment(cls: type) -> Any:
    hidden = {k: v for k, v in os.environ.items() if k.startswith(_SETTING_PREFIXES)}
    for key in hidden:
        del os.environ[key]
    try:
        return cls()
    finally:
        os.environ.update(hidden)


class KwargsHandler:
    """Base of the ``kwargs_handlers`` given to ``Accelerator``: only non-default fields count."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        default = _default_without_environment(self.__class__)
        return {k: v for k, v in self.to_dict().items() if getattr(default, k) != v}
