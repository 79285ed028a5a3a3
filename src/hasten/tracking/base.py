"""``GeneralTracker``, the interface every experiment tracker implements, and value conversion.

A tracker package is imported only inside a tracker's ``start`` (never when hasten is imported),
and only on the processes that run it. Values that a tracker cannot store are converted here,
once, with one warning per key, instead of crashing the run in the middle of training.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import warnings
from typing import Any, Callable, Mapping, Optional

from ..warning_kinds import HastenWarning

# A tensor with more elements than this is stored as a description, not as its values.
_MAX_LISTED_ELEMENTS = 64


def on_main_process(function: Callable) -> Callable:
    """Decorator for tracker methods: run on the main process only when ``self.main_process_only``.

    The check happens at call time, so a tracker can be built before the process group exists.
    """

    @functools.wraps(function)
    def run_if_allowed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not _is_main_process():
            return None
        return function(self, *args, **kwargs)

    return run_if_allowed


def _is_main_process() -> bool:
    from ..state import PartialState

    return PartialState().is_main_process


def missing_attributes(tracker: Any) -> list[str]:
    """The required tracker attributes that ``tracker`` (an instance or a class) does not define."""
    missing = [name for name in ("name", "requires_logging_directory") if not hasattr(tracker, name)]
    if "tracker" not in dir(tracker):  # a property that raises before start() still counts
        missing.append("tracker")
    return missing


class GeneralTracker:
    """Base class of experiment trackers; subclass it to plug in your own.

    A subclass defines ``name`` (str, how ``log_with`` and ``get_tracker`` refer to it),
    ``requires_logging_directory`` (bool: whether it is built with the project's logging
    directory), and a ``tracker`` property (the underlying run object, returned by
    ``get_tracker(name, unwrap=True)``). It may override ``start``, ``store_init_configuration``,
    ``log``, ``log_images``, ``log_table`` and ``finish``. ``main_process_only`` (default True)
    says whether it runs on the main process only or on every process.
    """

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = missing_attributes(self)
        if missing:
            raise NotImplementedError(
                f"tracker class {type(self).__name__} does not define {', '.join(missing)}; add them to the class "
                "(name: a string, requires_logging_directory: a bool, tracker: a property returning the run object)"
            )

    def start(self) -> None:
        """Create the run (called by ``init_trackers`` on the processes the tracker runs on)."""

    def store_init_configuration(self, values: dict) -> None:
        """Store ``values`` (str -> bool/int/float/str/None) as the run's hyperparameters."""

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """Log ``values`` (str -> number, str, ...) at ``step``."""

    def finish(self) -> None:
        """Close the run and flush what it holds."""


class RunTracker(GeneralTracker):
    """A tracker around one run object with ``log(values, step=...)`` and ``finish()`` (wandb-like APIs).

    Subclasses set ``name`` and ``package``/``module`` and create ``self.run`` in ``start``.
    """

    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class InertRun:
    """What ``get_tracker(..., unwrap=True)`` returns where a tracker does not run (non-main ranks).

    Any method called on it does nothing and returns None, so code such as
    ``accelerator.get_tracker("wandb", unwrap=True).log(...)`` needs no ``is_main_process`` guard.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Callable[..., None]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return lambda *args, **kwargs: None

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"InertRun({self._name!r}: this tracker runs on the main process only)"


def warn_once(message: str, _seen: set = set()) -> None:  # noqa: B006 - the set is the memory
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, HastenWarning, stacklevel=3)


# -- values ---------------------------------------------------------------------------------------
def scalar_or_none(value: Any) -> Optional[float]:
    """``value`` as a Python number when it is one (bool, int, float, one-element tensor/array)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)
    size = getattr(value, "numel", None) or getattr(value, "size", None)
    if callable(item) and (size() if callable(size) else size) == 1:
        try:
            number = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return number if isinstance(number, (bool, int, float)) else None
    return None


def plain_log_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """One-element tensors and NumPy scalars become Python numbers; other values are kept.

    Scripts often log ``loss.detach()`` or ``total / n`` as a tensor; every tracker accepts the
    number, while some silently drop (or choke on) the tensor.
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"accelerator.log() takes a dict of name -> value, got {type(values).__name__}")
    out = {}
    for key, value in values.items():
        number = scalar_or_none(value)
        out[str(key)] = value if number is None else number
    return out


def plain_value(value: Any, key: str, converted: list[str]) -> Any:
    """``value`` as bool/int/float/str/None or nested dicts and lists of those (JSON-like)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        converted.append(key)
        return plain_value(value.value, key, [])
    if isinstance(value, os.PathLike):
        converted.append(key)
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): plain_value(v, f"{key}.{k}", converted) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        converted.append(key)
        return plain_value(dataclasses.asdict(value), key, [])
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain_value(v, f"{key}[{i}]", converted) for i, v in enumerate(value)]
    number = scalar_or_none(value)
    if number is not None:
        converted.append(key)
        return number
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "tolist"):  # tensors and arrays
        converted.append(key)
        count = math.prod(shape)
        if count <= _MAX_LISTED_ELEMENTS:
            return value.tolist()
        return f"{type(value).__name__}(shape={list(shape)}, dtype={getattr(value, 'dtype', '?')})"
    converted.append(key)
    return repr(value)


def flatten(values: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested dicts as one level with joined keys; lists become their string form."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name, sep))
        elif isinstance(value, list):
            flat[name] = str(value)
        else:
            flat[name] = value
    return flat


def storable_config(values: Any, tracker: str, flat: bool = False) -> dict[str, Any]:
    """The run configuration in plain values (flattened for trackers that store one level only).

    Values that are converted (tensors, enums, paths, dataclasses, other objects) are named in
    one warning, so the user sees that the stored form differs from the object.
    """
    if values is None:
        return {}
    if isinstance(values, Mapping):
        source = values
    elif hasattr(values, "__dict__") and not isinstance(values, type):  # argparse.Namespace and the like
        source = vars(values)
    else:
        raise TypeError(f"init_trackers(config=...) takes a dict (or an argparse.Namespace), got {type(values).__name__}")
    converted: list[str] = []
    plain = {str(k): plain_value(v, str(k), converted) for k, v in source.items()}
    if converted:
        warn_once(f"{tracker}: config value(s) {converted[:10]}{' ...' if len(converted) > 10 else ''} are not plain "
                  "numbers or strings; they are stored converted (numbers, lists or their text)")
    return flatten(plain) if flat else plain
