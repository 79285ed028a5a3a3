"""The base class of the ``kwargs_handlers`` objects, kept apart so that both the configuration
objects (``dataclasses``) and the fp8 recipes (``fp8_recipes``) can build on it."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


class KwargsHandler:
    """Base of the ``kwargs_handlers`` given to ``Accelerator``: only non-default fields count."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        default = self.__class__()
        return {k: v for k, v in self.to_dict().items() if getattr(default, k) != v}
