"""Reading settings from the environment.

Every setting the launcher hands to its children travels as ``HASTEN_<NAME>``; for drop-in
compatibility the same setting is also read as ``ACCELERATE_<NAME>``. Ours wins when both are set.
This module must stay torch-free: the CLI imports it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

logger = logging.getLogger(__name__)

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


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore the previous values.

    Names are upper-cased and values turned into strings (``patch_environment(master_port=29501)``
    sets ``MASTER_PORT="29501"``). On exit each variable gets its old value back, or is removed if it
    did not exist, even when the block raised.
    """
    values = {key.upper(): str(value) for key, value in kwargs.items()}
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in previous.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextmanager
def clear_environment() -> Iterator[None]:
    """Run a block with an empty ``os.environ``; the original variables come back afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """``KEY=value\\n`` lines for the items of ``current_env`` that are safe to write to an env file (no
    ``; < >``, space or newline, neither side empty); the others are left out with a warning (logger
    ``hasten.utils.environment``, where Accelerate's lives)."""
    lines = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in ";\n<> "):
            lines.append(f"{key}={value}\n")
        else:
            logger.warning("Skipping %s=%s: it is empty or holds a character an env file cannot take", key, value)
    return lines


# Accelerate has these names in this module; hasten keeps them elsewhere (see accelerate_paths).
from .accelerate_paths import names_from_utils  # noqa: E402 - after the module's own names

__getattr__ = names_from_utils(__name__, (
    "str_to_bool", "get_int_from_env", "parse_flag_from_env", "parse_choice_from_env",
    "are_libraries_initialized", "get_current_device_type", "get_gpu_info", "check_cuda_p2p_ib_support",
    "check_cuda_fp8_capability", "get_cpu_distributed_information", "set_numa_affinity",
    "purge_accelerate_environment",
))
