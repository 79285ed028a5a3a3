"""Where checkpoints live and when one counts as complete (torch-free).

A checkpoint is a folder. It is written under a temporary name beside its target
(``.checkpoint_7.tmp-<token>``), every file is fsynced by the process that wrote it, then the
committing process writes ``manifest.json`` last and renames the folder into place (``commit`` runs
these steps in order; this module holds the leaves it calls and calls nothing back). A folder is
*complete* exactly when its manifest parses, has our format and version, and every file it lists is
present with the recorded size; anything else (temporary folders, folders of other libraries, folders
half-deleted by retention) is ignored by discovery and refused by loading.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import threading
import uuid
from typing import Any, Callable, Optional

from ..saving import fsync_path

MANIFEST = "manifest.json"
FORMAT = "hasten-checkpoint"
FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
_NUMBERED = re.compile(r"checkpoint_(\d+)")
_TEMP = re.compile(r"\.(.+)\.(tmp|old|trash)-([0-9a-f]{32})(-node\d+)?")


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint where one was expected."""


class IncompleteCheckpointError(ValueError):
    """A folder that is not a complete hasten checkpoint of a version this hasten reads."""


def new_token() -> str:
    return uuid.uuid4().hex


def auto_root(project_dir: Optional[str]) -> str:
    if project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming needs a project directory: pass Accelerator(project_dir=...) or "
            "ProjectConfiguration(project_dir=...)"
        )
    return os.path.join(os.path.abspath(os.path.expanduser(os.fspath(project_dir))), CHECKPOINTS_DIR)


def numbered(root: str) -> list[tuple[int, str]]:
    """``(N, path)`` of every ``checkpoint_N`` folder in ``root`` (complete or not), by N."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _NUMBERED.fullmatch(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def next_number(root: str, iteration: int) -> int:
    """The number of the next automatic checkpoint: ``iteration``, but never one already taken."""
    taken = [n for n, _ in numbered(root)]
    return max([iteration] + [n + 1 for n in taken])


def temp_path(target: str, token: str, kind: str = "tmp") -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.{kind}-{token}")


def files_in(folder: str) -> list[str]:
    """Every file under ``folder``, as paths relative to it."""
    out = []
    for directory, _, names in os.walk(folder):
        for name in names:
            out.append(os.path.relpath(os.path.join(directory, name), folder))
    return out


# -- manifest ----------------------------------------------------------------------------------------
def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest of ``folder`` after checking that the folder is complete; raises otherwise."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"checkpoint folder {folder!r} does not exist")
    if not os.path.isfile(path):
        raise IncompleteCheckpointError(
            f"{folder!r} has no {MANIFEST}: it is not a complete hasten checkpoint (an interrupted save, or a "
            "checkpoint written by another library); pass a folder written by hasten's save_state"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise IncompleteCheckpointError(f"{path!r} cannot be read ({e}); the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IncompleteCheckpointError(f"{path!r} is not a hasten checkpoint manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise IncompleteCheckpointError(
            f"{folder!r} has checkpoint format version {version!r}, but this hasten reads version {FORMAT_VERSION}; "
            + ("upgrade hasten to load it" if isinstance(version, int) and version > FORMAT_VERSION
               else "re-save it with this hasten's save_state")
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise IncompleteCheckpointError(f"{path!r} lists no files; the checkpoint is damaged")
    outside = [name for name in files if not _inside(folder, name)]
    if outside:
        raise IncompleteCheckpointError(
            f"{path!r} names files outside the checkpoint folder {folder!r}: "
            + ", ".join(repr(n) for n in outside[:5])
            + "; a manifest written by save_state only names files inside it, so this one is damaged or crafted "
            "(nothing was read)"
        )
    damaged = [name for name, info in files.items() if not isinstance(info, dict)]
    if damaged:
        raise IncompleteCheckpointError(f"{path!r} has no size for {damaged[:5]}; the checkpoint is damaged")
    missing, wrong = [], []
    for name, info in files.items():
        full = os.path.join(folder, name)
        if not os.path.isfile(full):
            missing.append(name)
        elif os.path.getsize(full) != info.get("size"):
            wrong.append(f"{name} ({os.path.getsize(full)} bytes, manifest says {info.get('size')})")
    if missing or wrong:
        problems = []
        if missing:
            problems.append("missing files: " + ", ".join(sorted(missing)[:10]))
        if wrong:
            problems.append("files of the wrong size: " + ", ".join(sorted(wrong)[:10]))
        raise IncompleteCheckpointError(f"checkpoint {folder!r} is incomplete: " + "; ".join(problems))
    return manifest


def _inside(folder: str, name: Any) -> bool:
    """Whether the manifest's file ``name`` stays inside ``folder``: a relative path without ``..``
    whose real location (symbolic links followed) is within the folder's."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\0" in name:
        return False
    if any(part in ("", ".", "..") for part in name.split("/")):
        return False
    real = os.path.realpath(folder)
    return os.path.commonpath([real, os.path.realpath(os.path.join(real, name))]) == real


def is_complete(folder: str) -> bool:
    try:
        read_manifest(folder)
    except (IncompleteCheckpointError, CheckpointNotFoundError):
        return False
    return True


def newest_complete(root: str) -> Optional[tuple[int, str]]:
    """``(N, path)`` of the complete checkpoint with the highest number in ``root``, if any."""
    for number, path in reversed(numbered(root)):
        if is_complete(path):
            return number, path
    return None


def write_manifest(folder: str, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` into ``folder`` (temp file, fsync, rename). The folder is fsynced once,
    by the commit protocol, right after: each fsync costs a device cache flush, even with nothing to write."""
    path = os.path.join(folder, MANIFEST)
    temp = path + ".tmp"
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


# -- rename into place and removal ------------------------------------------------------------------
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the system cannot."""
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def move_into_place(temp: str, target: str, token: str) -> None:
    """Move the finished folder ``temp`` to ``target`` atomically (replacing an older checkpoint there)
    and make the rename durable. ``temp``'s own entries must be durable already (``fsync_path``)."""
    parent = os.path.dirname(target)
    if os.path.lexists(target):
        if os.path.isdir(target) and not os.listdir(target):
            os.rmdir(target)
        elif not (os.path.isdir(target) and os.path.isfile(os.path.join(target, MANIFEST))):
            raise FileExistsError(
                f"save_state: {target!r} exists and is not a hasten checkpoint; hasten replaces only its own "
                "checkpoints, so pick another output_dir or remove it"
            )
    if not os.path.lexists(target):
        os.rename(temp, target)
        fsync_path(parent)
        return
    if _exchange(temp, target):  # temp now holds the old checkpoint
        fsync_path(parent)
        remove_tree(temp, token, background=True)
        return
    # No atomic swap here: move the old one aside first. A crash between the renames leaves the new
    # checkpoint complete under its temporary name and the old one under ".old-"; find_leftover()
    # reports both.
    old = temp_path(target, token, "old")
    os.rename(target, old)
    os.rename(temp, target)
    fsync_path(parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_tree(folder: str, token: Optional[str] = None, background: bool = False) -> None:
    """Delete a checkpoint so that no crash can leave it looking complete: rename, then delete.

    ``background``: delete the renamed folder in a thread (freeing gigabytes takes a while and the
    folder is already invisible to discovery; an interrupted deletion is finished by a later save).
    """
    if not os.path.lexists(folder):
        return
    trash = folder
    if not os.path.basename(folder).startswith("."):  # a temporary name already: discovery never looks
        trash = temp_path(folder, token or new_token(), "trash")
        os.rename(folder, trash)
        fsync_path(os.path.dirname(folder))
    if background:
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                         name="hasten-checkpoint-delete").start()
    else:
        shutil.rmtree(trash, ignore_errors=True)


def wait_for_deletions() -> None:
    """Block until background deletions of replaced or retired checkpoints have finished."""
    for thread in threading.enumerate():
        if thread.name == "hasten-checkpoint-delete":
            thread.join()


def apply_total_limit(root: str, total_limit: Optional[int], keep: str) -> list[str]:
    """Delete the oldest ``checkpoint_N`` folders beyond ``total_limit``; never ``keep`` (the new one).

    Runs only after ``keep`` is committed. Incomplete folders count as they sort (by N).
    Returns the deleted paths.
    """
    if total_limit is None:
        return []
    folders = numbered(root)
    excess = len(folders) - total_limit
    deleted = []
    keep = os.path.abspath(keep)
    for _, path in folders:
        if excess <= 0:
            break
        if os.path.abspath(path) == keep:
            continue
        remove_tree(path, background=True)
        deleted.append(path)
        excess -= 1
    return deleted


def clean_leftovers(parent: str, keep: str, ours: Callable[[str], bool]) -> list[str]:
    """Remove temporary, trash and old folders left in ``parent`` by interrupted saves/deletions.

    ``keep``: the token of the save in progress. ``ours(name)``: whether a leftover for the
    checkpoint called ``name`` belongs to this run; others are left alone, since another job
    saving beside ours (a sweep writing ``runs/a`` and ``runs/b``) may be writing them right now.
    """
    removed = []
    if not os.path.isdir(parent):
        return removed
    for name in os.listdir(parent):
        match = _TEMP.fullmatch(name)
        if not match or match.group(3) == keep or not ours(match.group(1)):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def automatic_name(name: str) -> bool:
    return _NUMBERED.fullmatch(name) is not None


def find_leftover(target: str) -> list[str]:
    """Complete checkpoints left under temporary names for ``target`` by a crash during a replace."""
    parent, name = os.path.split(target)
    if not os.path.isdir(parent):
        return []
    out = []
    for entry in os.listdir(parent):
        match = _TEMP.fullmatch(entry)
        if match and match.group(1) == name and match.group(2) in ("tmp", "old"):
            path = os.path.join(parent, entry)
            if is_complete(path):
                out.append(path)
    return out
