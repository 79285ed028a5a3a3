"""The one rule for opening a file named by a checkpoint: a plain file inside its folder, reached
without following any symbolic link (torch-free).

Manifests, DCP ``.metadata``, ``save_model`` indexes and offload indexes all name other files. A
crafted one could name ``../../etc/passwd``, an absolute path, or a symbolic link planted in the
folder. ``why_outside`` answers the question for a name; ``open_inside`` opens it so that the answer
cannot change in between: every component is opened relative to the one before with
``O_NOFOLLOW`` (a link swapped in after a check is refused by the kernel, not followed), and the
descriptor is ``fstat``-ed to be a regular file. What is read afterwards comes from that descriptor.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, Optional

from .errors import UnsafeFileError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO for reading must not wait for a writer
_RELATIVE = _NOFOLLOW and os.open in os.supports_dir_fd


def _syntax(name: Any, nested: bool, suffix: str) -> Optional[str]:
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\0" in name or "\\" in name:
        return "not a relative path"
    parts = (name + suffix).split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "not a plain relative path"
    if len(parts) > 1 and not nested:
        return "not a plain file name"
    return None


def why_outside(folder: str, name: Any, nested: bool = True, suffix: str = "") -> Optional[str]:
    """Why ``name`` (plus ``suffix``) does not name a file inside ``folder``; None when it does.

    It must be a non-empty relative path with ``/`` separators and no ``.``/``..``/empty parts (one
    part only unless ``nested``), none of whose parts is a symbolic link, that resolves inside
    ``folder``. A check of the name only: reading goes through ``open_inside``, which holds to it.
    """
    why = _syntax(name, nested, suffix)
    if why:
        return why
    path = folder
    for part in (name + suffix).split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return f"{os.path.relpath(path, folder)} is a symbolic link"
    real = os.path.realpath(folder)
    if os.path.commonpath([real, os.path.realpath(os.path.join(real, name + suffix))]) != real:
        return "resolves outside"
    return None


def open_inside(folder: str, name: Any, what: str = "file", nested: bool = True) -> int:
    """A read-only descriptor of the plain file ``name`` inside ``folder`` (``folder`` itself may be
    reached through links: the caller chose it). Raises ``FileNotFoundError`` when it is missing and
    ``UnsafeFileError`` (naming the file and what is wrong) for a name leaving the folder, a symbolic
    link on the way, or anything but a regular file at the end."""
    full = os.path.join(folder, name) if isinstance(name, str) else repr(name)
    why = _syntax(name, nested, "")
    if why:
        raise UnsafeFileError(f"the {what} {full!r} is {why} inside {folder!r}; hasten reads only plain names of "
                              "files inside the folder (nothing was read)")
    parts = name.split("/")
    if not _RELATIVE:  # no O_NOFOLLOW/dir_fd (Windows): check, then open (a narrower guarantee)
        why = why_outside(folder, name, nested)
        if why:
            raise UnsafeFileError(f"the {what} {full!r} is not a plain file inside {folder!r} ({why}); copy the real "
                                  "file in instead of linking it (nothing was read)")
        return _checked(os.open(full, os.O_RDONLY | getattr(os, "O_BINARY", 0)), full, what)
    try:
        current = os.open(folder, os.O_RDONLY | _DIRECTORY)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"the folder of the {what} {full!r} does not exist", folder) from None
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | _NOFOLLOW | (_NONBLOCK if last else _DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=current)
            except OSError as e:
                where = os.path.join(folder, *parts[:i + 1])
                if e.errno == errno.ENOENT:
                    raise FileNotFoundError(errno.ENOENT, f"the {what} {full!r} does not exist", full) from None
                if e.errno in (errno.ELOOP, errno.EMLINK) or (e.errno == errno.ENOTDIR and os.path.islink(where)):
                    raise UnsafeFileError(f"{where!r} is a symbolic link, which may lead anywhere; hasten reads the "
                                          f"{what} {full!r} only as a plain file inside {folder!r} (copy the real file "
                                          "in instead of linking it; nothing was read)") from None
                if e.errno == errno.ENOTDIR:
                    raise UnsafeFileError(f"{where!r} is not a folder, so the {what} {full!r} cannot be inside it "
                                          "(nothing was read)") from None
                raise
            os.close(current)
            current = nxt
        fd, current = current, -1
    finally:
        if current >= 0:
            os.close(current)
    return _checked(fd, full, what)


def _checked(fd: int, full: str, what: str) -> int:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise UnsafeFileError(f"the {what} {full!r} is {kind}; hasten reads only plain files (nothing was read)")
    if _NONBLOCK:
        os.set_blocking(fd, True)
    return fd


def read_inside(folder: str, name: Any, what: str = "file", nested: bool = True) -> bytes:
    """The whole content of the plain file ``name`` inside ``folder`` (see ``open_inside``)."""
    fd = open_inside(folder, name, what, nested)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def is_link(path: str) -> bool:
    """Whether ``path`` itself is a symbolic link (for folders a caller is about to read from; files are
    opened with ``open_inside``, which refuses links on the way)."""
    return os.path.islink(path)


def hub_blob(path: str) -> Optional[tuple[str, str]]:
    """``(blobs folder, blob name)`` when ``path`` is a link of a Hugging Face cache snapshot
    (``<repo>/snapshots/<revision>/<file>``) to a plain file of that repository's ``<repo>/blobs/``: the
    one layout of links a weights folder legitimately has, and it stays inside the repository's cache
    folder. None for anything else."""
    if not os.path.islink(path):
        return None
    snapshot = os.path.dirname(os.path.abspath(path))
    snapshots = os.path.dirname(snapshot)
    if os.path.basename(snapshots) != "snapshots":
        return None
    blobs = os.path.join(os.path.realpath(os.path.dirname(snapshots)), "blobs")
    real = os.path.realpath(path)
    try:
        plain = stat.S_ISREG(os.lstat(real).st_mode)
    except OSError:
        return None
    return (blobs, os.path.basename(real)) if plain and os.path.dirname(real) == blobs else None


def split(path: str) -> tuple[str, str]:
    """``(folder, name)`` of a path given by a caller, for ``open_inside``."""
    path = os.fspath(path)
    return os.path.dirname(path) or ".", os.path.basename(path)
