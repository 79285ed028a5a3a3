"""Which trackers exist, which are installed, and turning ``log_with`` into a checked list.

Availability is decided with ``importlib.util.find_spec``, which finds a package without importing
it: choosing trackers never imports wandb, mlflow & co.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from typing import Any, Callable, Optional

from ..utils.dataclasses import LoggerType
from .base import GeneralTracker, missing_attributes, warn_once
from .hosted import ClearMLTracker, CometMLTracker, MLflowTracker, SwanLabTracker, WandBTracker
from .local import AimTracker, DVCLiveTracker, TensorBoardTracker, TrackioTracker

LOGGER_TYPE_TO_CLASS: dict[str, type] = {
    cls.name: cls for cls in (AimTracker, CometMLTracker, MLflowTracker, TensorBoardTracker, WandBTracker,
                              ClearMLTracker, DVCLiveTracker, SwanLabTracker, TrackioTracker)
}
# The pip extra that installs each built-in tracker: pip install 'hasten[<extra>]'.
EXTRAS = {name: name.replace("_", "-") for name in LOGGER_TYPE_TO_CLASS}
_ALTERNATIVE_MODULES = {"tensorboard": ("tensorboardX",), "mlflow": ()}


def _installed(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def is_tracker_available(name: str) -> bool:
    """Whether the package behind the built-in tracker ``name`` is installed (it is not imported)."""
    cls = LOGGER_TYPE_TO_CLASS[name]
    builtin = getattr(cls, "module", None)
    if builtin is None:  # a registered custom tracker: it brings its own code
        return True
    return any(_installed(m) for m in (builtin, *_ALTERNATIVE_MODULES.get(name, ())))


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers whose package is installed."""
    return [LoggerType(name) for name in LOGGER_TYPE_TO_CLASS
            if name in LoggerType._value2member_map_ and is_tracker_available(name)]


class NotATrackerClass(TypeError, ValueError):
    """``register_tracker_class`` got something that is not a ``GeneralTracker`` subclass: a TypeError,
    and a ValueError too, which is what Accelerate raises (scripts catch that)."""


def register_tracker_class(tracker_class: type) -> None:
    """Make a ``GeneralTracker`` subclass selectable by its ``name`` in ``log_with``.

    ``init_trackers`` builds it as ``cls(project_name, [logging_dir,] **init_kwargs[name])``.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise NotATrackerClass(f"register_tracker_class takes a GeneralTracker subclass, got {tracker_class!r}")
    missing = [m for m in missing_attributes(tracker_class) if m != "tracker"]
    if missing or not tracker_class.name:
        raise ValueError(f"register_tracker_class({tracker_class.__name__}): define {missing or ['name']} on the class")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warn_once(f"register_tracker_class: {tracker_class.__name__} replaces the tracker named {tracker_class.name!r}")
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def _missing_package_error(name: str) -> ImportError:
    cls = LOGGER_TYPE_TO_CLASS[name]
    return ImportError(
        f"log_with={name!r} needs the {cls.package!r} package, which is not installed; "
        f"install it with: pip install 'hasten[{EXTRAS[name]}]' (or: pip install {cls.package})"
    )


def _needs_directory_error(name: str) -> ValueError:
    return ValueError(  # Accelerate's words first (code written for it matches them), then the fix
        f"Logging with `{name}` requires a `logging_dir` to be passed in: log_with={name!r} writes into a logging "
        "directory, and none is set; pass Accelerator(project_dir='runs') or "
        "project_config=ProjectConfiguration(logging_dir=...)"
    )


def _check_instance(tracker: Any) -> GeneralTracker:
    if isinstance(tracker, type):
        raise TypeError(f"log_with got the class {tracker.__name__}; pass an instance: log_with={tracker.__name__}(...)")
    if not isinstance(tracker, GeneralTracker):
        raise TypeError(
            f"log_with got {tracker!r} ({type(tracker).__name__}); use a tracker name ({', '.join(LoggerType.list())}), "
            "a LoggerType, an instance of a GeneralTracker subclass, or a list of these"
        )
    missing = missing_attributes(tracker)
    if missing:
        raise NotImplementedError(
            f"tracker {type(tracker).__name__} given in log_with does not define {', '.join(missing)}; add them to "
            "the class (name: a string, requires_logging_directory: a bool, tracker: a property returning the run)"
        )
    return tracker


def _name_of(entry: Any) -> str:
    name = entry.value if isinstance(entry, LoggerType) else str(entry).strip().lower()
    if name == "comet-ml":
        name = "comet_ml"
    if name != "all" and name not in LOGGER_TYPE_TO_CLASS:
        known = ["all", *LOGGER_TYPE_TO_CLASS]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"log_with={entry!r} is not a known tracker; {hint}use one of {known} or a GeneralTracker instance")
    return name


def filter_trackers(log_with: Any, logging_dir: Optional[str] = None,
                    say: Callable[[str], None] = lambda message: None) -> list[Any]:
    """``log_with`` as a list of ``LoggerType`` members and tracker instances, checked.

    A tracker named explicitly must be installed (else ImportError naming the package) and
    have its logging directory when it needs one. ``"all"`` adds every installed built-in
    tracker (those needing a directory only when one is set) and ``say``s which.
    """
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    chosen: list[Any] = []
    names: list[str] = []
    wants_all = False
    for entry in entries:
        if isinstance(entry, (str, LoggerType)):
            name = _name_of(entry)
            if name == "all":
                wants_all = True
                continue
            if not is_tracker_available(name):
                raise _missing_package_error(name)
            if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
                raise _needs_directory_error(name)
            if name not in names:
                names.append(name)
                chosen.append(LoggerType(name) if name in LoggerType._value2member_map_ else name)
        else:
            chosen.append(_check_instance(entry))
    if wants_all:
        found, skipped = [], []
        for name in LOGGER_TYPE_TO_CLASS:
            if name in names or not is_tracker_available(name):
                continue
            if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
                skipped.append(name)
                continue
            found.append(name)
            names.append(name)
            chosen.append(LoggerType(name) if name in LoggerType._value2member_map_ else name)
        note = (f" ({', '.join(skipped)} skipped: they need a logging directory; pass Accelerator(project_dir=...))"
                if skipped else "")
        if found:
            say(f"log_with='all' uses the installed trackers: {', '.join(found)}{note}")
        else:
            say(f"log_with='all' found no installed tracker{note}; nothing is tracked. "
                "Install one, e.g. pip install 'hasten[tensorboard]'")
    return chosen
