"""Version comparisons (``compare_versions``, ``is_torch_version``) without importing the package compared."""

from __future__ import annotations

import importlib.metadata
import operator
from types import ModuleType
from typing import Any, Union

from packaging.version import Version, parse

_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
               "<=": operator.le, "<": operator.lt}


def _operation(operation: str):  # noqa: ANN202 - one of the operator functions
    try:
        return _OPERATIONS[operation]
    except KeyError:
        raise ValueError(f"operation={operation!r}; use one of {list(_OPERATIONS)}") from None


def compare_versions(library_or_version: Union[str, Version, ModuleType], operation: str,
                     requirement_version: str) -> bool:
    """Compare a library's installed version (a distribution name, a version, or an imported module)
    with ``requirement_version`` using ``operation`` (one of ``> >= == != <= <``)."""
    compare = _operation(operation)
    if isinstance(library_or_version, ModuleType):
        library_or_version = library_or_version.__version__
    if isinstance(library_or_version, str) and not library_or_version[:1].isdigit():
        library_or_version = importlib.metadata.version(library_or_version)  # a distribution name
    return compare(parse(str(library_or_version)), parse(requirement_version))


def _torch_version() -> Version:
    # The installed distribution's version: reading it does not import torch.
    return parse(importlib.metadata.version("torch"))


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the installed torch's version compares to ``version`` as ``operation`` says
    (e.g. ``is_torch_version(">=", "2.4")``). As in Accelerate, the whole version counts: ``2.4.0+cu124``
    is greater than ``2.4.0``, so ``is_torch_version("==", "2.4.0")`` is False for it."""
    return _operation(operation)(_torch_version(), parse(version))


# Fallbacks for the oldest torch that pyproject.toml allows. Every place where hasten's code differs by
# torch version goes through a function here (found by trying the feature, not by comparing numbers),
# so that `make smoke-min` on that torch covers all of them and raising the minimum removes them in one place.


def elastic_launch_config(**kwargs: Any) -> Any:
    """torch's elastic ``LaunchConfig`` from ``kwargs``. ``shutdown_timeout`` (the grace between SIGTERM
    and SIGKILL of the workers) is newer than torch 2.6; there it is dropped and torch's fixed 30 s grace
    applies."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    known = {field.name for field in dataclasses.fields(LaunchConfig)}
    if "shutdown_timeout" not in known:
        kwargs.pop("shutdown_timeout", None)
    return LaunchConfig(**kwargs)


def dynamo_traces_autocast_hooks() -> bool:
    """Whether dynamo can trace hasten's autocast hooks where it inlines them (``torch.amp._enter_autocast``
    in a pre-hook, ``_exit_autocast`` in the forward hook). Tracing them came with pytorch#173877
    (``_UnmanagedAutocast``), restoring the autocast dtype after a graph break between the two with
    pytorch#186530; torch 2.13 is the first release checked with both (tests/test_fullgraph_autocast.py).
    Older torch runs the inlined hooks outside the graph (a graph break, so no ``fullgraph=True``)."""
    import torch

    return hasattr(torch.amp.autocast_mode, "_UnmanagedAutocast") and is_torch_version(">=", "2.13")
