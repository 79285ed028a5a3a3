"""A logger for multi-process runs: logs on the main process only unless asked otherwise.

``get_logger(__name__)`` works like ``accelerate.logging.get_logger``. One difference: Accelerate
raises when a message is logged before ``PartialState``/``Accelerator`` exists; hasten logs it
normally (as a single process would) instead. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from .utils.environment import get_env


def _state() -> Any:
    """The initialised ``PartialState``, or None (without importing torch when nothing did yet)."""
    module = sys.modules.get("hasten.state")
    if module is None:
        return None
    state = module.PartialState._shared_state
    return module.PartialState() if state.get("device") is not None else None


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` whose calls take ``main_process_only`` (default True) and ``in_order``.

    ``main_process_only=True`` logs on process 0 only; ``False`` on every process; ``in_order=True``
    on every process, one after the other in rank order (each process waits for the others).
    In multi-process runs messages are prefixed with ``[RANK i]``.
    """

    def __init__(self, logger: logging.Logger, extra: Any = None, **kwargs: Any) -> None:
        super().__init__(logger, extra, **kwargs)
        self._warned_messages: set = set()  # (msg, args) already given to warning_once

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        state = _state()
        if state is not None and state.num_processes > 1:
            msg = f"[RANK {state.process_index}] {msg}"
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True, in_order: bool = False,
            **kwargs: Any) -> None:
        # 2 skips this frame so that records name the caller's file and line. A stacklevel the caller
        # gives is passed on as it is (as Accelerate does): wrappers tuned against it stay right.
        kwargs.setdefault("stacklevel", 2)
        state = _state()
        if state is None or state.num_processes == 1:
            if self.isEnabledFor(level):
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        if in_order:
            # Every process must take part in the barriers, even where the level is disabled.
            enabled = self.isEnabledFor(level)
            if enabled:
                msg, kwargs = self.process(msg, kwargs)
            for rank in range(state.num_processes):
                if rank == state.process_index and enabled:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
            return
        if self.isEnabledFor(level) and (not main_process_only or state.is_main_process):
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)

    def warning_once(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        """``warning`` that emits a given message (with its arguments) only once per logger."""
        key = (msg, args)
        try:
            if key in self._warned_messages:
                return
            self._warned_messages.add(key)
        except TypeError:  # unhashable arguments: cannot remember them, log every time
            pass
        kwargs["stacklevel"] = kwargs.get("stacklevel", 2) + 1  # this frame too
        self.log(logging.WARNING, msg, *args, **kwargs)


def get_logger(name: str, log_level: Optional[str] = None) -> MultiProcessAdapter:
    """A multi-process-aware logger for ``name`` (e.g. ``__name__``).

    Args:
        name: the logger's name.
        log_level: its level ("DEBUG", "INFO", ...); defaults to the ``HASTEN_LOG_LEVEL`` (else
            ``ACCELERATE_LOG_LEVEL``) environment variable, else the logger's own level is kept.
    """
    if log_level is None:
        log_level = get_env("LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None and log_level != "":
        level = log_level.upper() if isinstance(log_level, str) else log_level
        try:
            logger.setLevel(level)
        except (ValueError, TypeError):
            raise ValueError(
                f"log_level={log_level!r} is not a logging level; use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
            ) from None
    return MultiProcessAdapter(logger, {})
