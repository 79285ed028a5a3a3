"""Durable writes (torch-free): fsync that fails the save on a real I/O error, and the one
temporary-file-then-rename.

A file goes to a temporary name in its own directory, is flushed and fsynced, then renamed over the
destination and the directory fsynced, so a crash leaves the old file or the new one, never a torn
one. Directory-level moves of whole checkpoints (exchange, recovery) are ``checkpointing/layout.py``'s,
built on ``fsync_path``.
"""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from typing import IO, Any, Callable, Iterator, Union

from ..progress import file_io

PathLike = Union[str, "os.PathLike[str]"]


def _temporary_next_to(path: PathLike) -> tuple[str, str]:
    """(real destination, new empty temporary file in its directory) for ``path``."""
    target = os.path.realpath(os.fspath(path))
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"cannot write {os.fspath(path)!r}: its directory {directory!r} does not exist; create it first"
        )
    if os.path.isdir(target):
        raise IsADirectoryError(f"cannot write {os.fspath(path)!r}: it is a directory; pass a file path")
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    return target, tmp


def _remove_quietly(paths: list[str]) -> None:
    for tmp in paths:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass


@contextmanager
def atomic_path(path: PathLike, sync_folder: bool = True) -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds, it replaces ``path``.

    For writers that want a file name (``torch.save``, safetensors' ``save_file``). The data is
    fsynced before the rename and the directory after it. If the block raises, the temporary file
    is removed and an existing ``path`` is untouched. Symbolic links are written through.
    ``sync_folder=False``: the caller fsyncs the directory once, after several files.
    """
    with atomic_paths([path], sync_folder) as tmps:
        yield tmps[0]


@contextmanager
def atomic_paths(paths: "list[PathLike]", sync_folder: bool = True) -> Iterator[list[str]]:
    """``atomic_path`` for a set of files that belong together (the shards of a ``save_model``, the files
    of an offload folder next to the index that records their checksums): one temporary path each; only
    when the block succeeded and every one of them was fsynced are they renamed into place, one after the
    other. A failure anywhere before (a full disk on the third file, an fsync error on the last) removes
    every temporary file and leaves all the destinations as they were, so an earlier save stays whole."""
    made: list[tuple[str, str]] = []
    try:
        for path in paths:
            made.append(_temporary_next_to(path))
        yield [tmp for _, tmp in made]
        for target, tmp in made:
            _fsync_file(tmp)
        for target, tmp in made:
            _copy_mode(tmp, target)
        for target, tmp in made:  # a crash in here leaves some renamed: the loaders refuse that mix (save ids)
            os.replace(tmp, target)
    except BaseException:
        _remove_quietly([tmp for _, tmp in made])
        raise
    if sync_folder:
        for directory in sorted({os.path.dirname(target) for target, _ in made}):
            fsync_path(directory)


@contextmanager
def atomic_write(path: PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Open ``path`` for writing so that it appears complete or not at all.

    Yields a file object on a temporary file in the same directory; on success the data is flushed,
    fsynced and renamed over ``path``. If the block raises, the temporary file is removed and the
    previous ``path`` (if any) is unchanged. Text modes default to UTF-8.
    """
    if not mode.startswith("w") or any(c in mode for c in "ax+r"):
        raise ValueError(f"atomic_write mode={mode!r} is not a write mode; use 'wb' or 'w' (appending cannot be atomic)")
    if "b" not in mode:
        open_kwargs.setdefault("encoding", "utf-8")
    with atomic_path(path) as tmp:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
        # atomic_path fsyncs the closed file before the rename (a second fsync would flush the device again).


def write_atomically(path: PathLike, writer: Callable[[str], Any]) -> None:
    """Call ``writer(tmp_path)`` and atomically move what it wrote to ``path`` (see ``atomic_path``)."""
    with atomic_path(path) as tmp:
        writer(tmp)


# errnos with which fsync says "this file cannot be synchronised here" (fsync(2): EINVAL and EROFS for
# objects that do not support it; ENOTSUP/ENOSYS from some FUSE and network filesystems, and
# directories on some systems). Anything else (EIO, ENOSPC, EDQUOT, ...) means the data may not be
# on the disk, and the save that asked must fail instead of committing it.
_FSYNC_UNSUPPORTED = frozenset(getattr(errno, name) for name in ("EINVAL", "EROFS", "ENOTSUP", "EOPNOTSUPP", "ENOSYS")
                               if hasattr(errno, name))


def fsync_fd(fd: int, path: str) -> None:
    """``os.fsync(fd)`` of ``path``; "not supported" errnos are ignored, any other error is raised
    as an ``OSError`` naming ``path``."""
    try:
        with file_io():
            os.fsync(fd)
    except OSError as e:
        if e.errno in _FSYNC_UNSUPPORTED:
            return
        raise OSError(e.errno, f"fsync of {path!r} failed ({e.strerror or e}): its data may not be on the disk",
                      path) from None


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames and new entries durable).

    Skipped only where it cannot be done (a directory on Windows, "not supported" errnos, see
    ``fsync_fd``); any other failure (EIO, ENOSPC, ...) raises.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if os.name == "nt" and os.path.isdir(path):  # Windows cannot open a directory
            return
        raise
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def _copy_mode(tmp: str, target: str) -> None:
    # mkstemp makes 0600 files; give the result the permissions a plain open() would have.
    try:
        mode = os.stat(target).st_mode & 0o7777 if os.path.exists(target) else 0o666 & ~_umask()
        os.chmod(tmp, mode)
    except OSError:
        pass


_UMASK: list[int] = []


def _umask() -> int:
    if not _UMASK:
        value = None
        try:  # Linux: read it without changing it (os.umask is process-wide and racy)
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("Umask:"):
                        value = int(line.split()[1], 8)
        except (OSError, ValueError):
            pass
        if value is None:
            value = os.umask(0o022)
            os.umask(value)
        _UMASK.append(value)
    return _UMASK[0]


def write_new(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (a new file of a folder that is renamed into place later) and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        fsync_fd(f.fileno(), path)
