"""A progress bar shown once per machine (tqdm is optional: imported on first use)."""

from __future__ import annotations

import sys
import types
from typing import Any


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` bar, disabled on every process but each machine's main one.

    Takes tqdm's own arguments. ``main_process_only=False`` shows it on every process. For older
    Accelerate scripts, ``main_process_only`` may also come first as a positional bool:
    ``tqdm(True, range(10))``.
    """
    if args and isinstance(args[0], bool):
        main_process_only, args = args[0], args[1:]
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError:
        raise ImportError("hasten.utils.tqdm needs the tqdm package; install it with `pip install tqdm`") from None
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        from ..state import PartialState

        disable = PartialState().local_process_index != 0
    return _tqdm(*args, disable=disable, **kwargs)


class _CallableModule(types.ModuleType):
    """``hasten.utils.tqdm`` is both this module and the function: importing the module sets it as
    the package attribute ``tqdm``, so ``from hasten.utils import tqdm`` may return either."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return tqdm(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
