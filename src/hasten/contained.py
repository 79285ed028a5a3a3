"""Whether a file name read from a file stays inside its folder (torch-free).

Manifests, DCP ``.metadata``, ``save_model`` indexes and offload indexes all name other files. A
crafted one could name ``../../etc/passwd``, an absolute path, or a symbolic link planted in the
folder; every reader asks this one question the same way before opening anything.
"""

from __future__ import annotations

import os
from typing import Any, Optional


def why_outside(folder: str, name: Any, nested: bool = True, suffix: str = "") -> Optional[str]:
    """Why ``name`` (plus ``suffix``) does not name a file inside ``folder``; None when it does.

    It must be a non-empty relative path with ``/`` separators and no ``.``/``..``/empty parts (one
    part only unless ``nested``), none of whose parts is a symbolic link, that resolves inside
    ``folder``.
    """
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\0" in name or "\\" in name:
        return "not a relative path"
    parts = (name + suffix).split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "not a plain relative path"
    if len(parts) > 1 and not nested:
        return "not a plain file name"
    path = folder
    for part in parts:
        path = os.path.join(path, part)
        if os.path.islink(path):
            return f"{os.path.relpath(path, folder)} is a symbolic link"
    real = os.path.realpath(folder)
    if os.path.commonpath([real, os.path.realpath(os.path.join(real, name + suffix))]) != real:
        return "resolves outside"
    return None
