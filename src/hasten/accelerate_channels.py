"""How hasten says what Accelerate says, where code written for Accelerate observes it (standard library only).

The rule: what hasten adds is invisible to such code. Where Accelerate logs a record, hasten logs
one on the same logger name (the word ``accelerate`` replaced), at the same level, containing
Accelerate's words, so ``assertLogs``/``caplog`` see it and ``-W error`` does not turn it into an
exception. Where Accelerate's exception text is compared exactly, ``str(error)`` is that text and
hasten's fix travels as a note (printed under the traceback on Python 3.11+).
"""

from __future__ import annotations

import logging


def add_note(error: BaseException, note: str) -> BaseException:
    """Attach ``note`` to ``error`` (shown below its message in a traceback; ``str(error)`` unchanged)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: kept where 3.11's traceback would look for it
        error.__notes__ = [*getattr(error, "__notes__", []), note]
    return error


def log_warning(logger_name: str, message: str) -> None:
    """A WARNING record on ``logger_name`` (hasten's spelling of Accelerate's logger, e.g. ``hasten.utils.modeling``)."""
    logging.getLogger(logger_name).warning(message)
