"""Stand-ins for Accelerate names whose feature hasten does not have (``compat.REFUSED``).

Importing one works, so a script that imports it still loads; creating or calling it raises
``FeatureNotAvailableError`` naming the alternative. Classes stay classes (``isinstance`` checks and
annotations keep working); everything else is a function.
"""

from __future__ import annotations

from typing import Any, NoReturn

from .compat import REFUSED, FeatureNotAvailableError, refusal

__all__ = ["FeatureNotAvailableError"]

_MADE: dict[str, Any] = {}


def _placeholder(name: str) -> Any:
    if name[:1].isupper():
        def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
            raise refusal(name)

        return type(name, (), {"__init__": __init__, "__doc__": f"Not available in hasten: {REFUSED[name]}",
                               "__module__": __name__})

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise refusal(name)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Not available in hasten: {REFUSED[name]}"
    return refused


def __getattr__(name: str) -> Any:
    if name not in REFUSED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _MADE:
        _MADE[name] = _placeholder(name)
    return _MADE[name]
