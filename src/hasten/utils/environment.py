"""Reading settings from the environment.

Every setting the launcher hands to its children travels as ``HASTEN_<NAME>``; for drop-in
compatibility the same setting is also read as ``ACCELERATE_<NAME>``. Ours wins when both are set.
This module must stay torch-free: the CLI imports it.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

PREFIXES = ("HASTEN_", "ACCELERATE_")

# Accelerate spells a few names differently from the setting they carry.
_ALIASES = {"DEBUG": ("HASTEN_DEBUG", "ACCELERATE_DEBUG_MODE")}

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def env_names(name: str) -> tuple[str, ...]:
    """The environment variable names that carry setting ``name``, most specific first."""
    return _ALIASES.get(name, tuple(p + name for p in PREFIXES))


def get_env(name: str, default: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The raw value of setting ``name`` (``HASTEN_NAME``, else ``ACCELERATE_NAME``), else ``default``."""
    environ = os.environ if environ is None else environ
    for key in env_names(name):
        value = environ.get(key)
        if value is not None:
            return value
    return default


def parse_flag(name: str, default: bool = False, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A boolean setting; an unreadable value is an error that names the variable."""
    raw = get_env(name, None, environ)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"environment variable for {name} has value {raw!r}, which is not a boolean; "
        f"set one of {env_names(name)} to 1/true/yes or 0/false/no"
    )


def parse_int(name: str, default: int, environ: Optional[Mapping[str, str]] = None) -> int:
    """An integer setting; an unreadable value is an error that names the variable."""
    raw = get_env(name, None, environ)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable for {name} has value {raw!r}, which is not an integer; "
            f"set one of {env_names(name)} to a whole number"
        ) from None


def parse_choice(name: str, default: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """A string setting, lower-cased."""
    raw = get_env(name, None, environ)
    return default if raw is None or raw == "" else raw.strip().lower()
