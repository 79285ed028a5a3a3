"""The one exception type of the CLI, and the did-you-mean helper.

Any mistake the user can fix (a bad flag, key, value or file) raises ``HastenCLIError``; ``main()``
prints it as one line ``hasten: error: ...`` and exits with status 2, never with a traceback.
"""

from __future__ import annotations

import difflib
from typing import Iterable


class HastenCLIError(ValueError):
    """A user error: the message names the wrong flag/key/value and how to fix it (one line).

    A ``ValueError``, as Accelerate's launcher raises for a bad config or flag, so that code which
    launches from Python (``launch_command``) catches the same type on either library.
    """

    exit_code = 2


class MissingFileError(HastenCLIError, FileNotFoundError):
    """A file the user named does not exist (also a ``FileNotFoundError``, as Accelerate raises)."""


class FileInTheWayError(HastenCLIError, FileExistsError):
    """A file would be replaced without ``--overwrite`` (also a ``FileExistsError``, as Accelerate raises)."""


def did_you_mean(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the closest candidate, or ``""`` when none is close."""
    names = list(candidates)
    stripped = word.lstrip("-").replace("-", "_").lower()
    lookup = {c.lstrip("-").replace("-", "_").lower(): c for c in names}
    match = difflib.get_close_matches(stripped, list(lookup), n=1, cutoff=0.6)
    if not match:
        # A prefix that is unique is a strong hint too (e.g. --num_proc).
        starts = [c for key, c in lookup.items() if key.startswith(stripped) and stripped]
        if len(starts) == 1:
            return f"; did you mean '{prefix}{starts[0]}'?"
        return ""
    return f"; did you mean '{prefix}{lookup[match[0]]}'?"
