"""The category of hasten's own warnings (standard library only; cheap to import).

``HastenWarning`` is a ``UserWarning``, so code and filters written for Accelerate's plain
``UserWarning``s keep working, and users can single hasten's messages out:
``warnings.filterwarnings("ignore", category=HastenWarning)`` or
``-W ignore::hasten.warning_kinds.HastenWarning``. The library only picks the category; how a
warning looks is left to Python (``file:line: HastenWarning: ...``), except in the processes that
``hasten launch`` starts, whose bootstrap shows them as ``hasten: warning: ...``.
"""


class HastenWarning(UserWarning):
    """A warning written by hasten itself (not by torch or a user's script)."""
