"""Accelerate's module paths for names that hasten keeps in another module.

A script imports ``from accelerate.utils.deepspeed import get_active_deepspeed_plugin``; in hasten that
function lives in ``utils/deepspeed_compat.py``. Rather than a second copy, the module on Accelerate's
path answers the name through ``hasten.utils``, which knows where each name lives (one implementation,
looked up when first used: importing the module stays as cheap as it was). Nothing here imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable


def names_from_utils(module: str, names: Iterable[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` that answers ``names`` from ``hasten.utils``."""
    wanted = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name not in wanted:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module("hasten.utils"), name)

    return __getattr__
