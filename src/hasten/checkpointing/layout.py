"""Where checkpoints live and when one counts as complete (torch-free).

A checkpoint is a folder. It is written under a temporary name beside its target
(``.checkpoint_7.tmp-<token>``), every file is fsynced by the process that wrote it, then the
committing process writes ``manifest.json`` last and renames the folder into place (``commit`` runs
these steps in order; this module holds the leaves it calls and calls nothing back). A folder is
*complete* exactly when its manifest parses, has our format and version, its own checksum matches,
every name it lists is a real file inside the folder (no ``..``, absolute path or symbolic link) and
is present with the recorded size; anything else (temporary folders, folders of other libraries,
folders half-deleted by retention) is ignored by discovery and refused by loading.

Discovery takes only the names hasten writes (``checkpoint_`` + ASCII digits, no leading zero) that
are real folders, never symbolic links. A crash mid-commit can leave a complete checkpoint under a
temporary name with its final name missing; ``recover`` renames it back (discovery, load_state and
save_state call it) when a replace was under way, and neither retention nor leftover cleaning
deletes such a checkpoint. A save that never reached its rename is not committed: its temporary
folder stays a leftover, cleaned by a later save. fsync
errors other than "not supported" fail the save (``files.durable.fsync_fd``); a rename whose directory
cannot be fsynced is undone.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import stat
import threading
import uuid
from typing import Any, Callable, Optional

from ..files.durable import atomic_path, fsync_path
from ..files.errors import (  # noqa: F401 - the public names of checkpoint errors
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DamagedManifestError,
    IncompleteCheckpointError,
    UnsafeFileError,
)
from ..files.paths import is_link, read_inside, why_outside
from ..warning_kinds import HastenWarning

MANIFEST = "manifest.json"
FORMAT = "hasten-checkpoint"
# 2: the manifest carries its own checksum. Version 1 manifests (written before) are still read, without it.
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
CHECKPOINTS_DIR = "checkpoints"
CHECKSUM_KEY = "manifest_checksum"
# Only the names hasten writes: ASCII digits without leading zeros (``int()`` also takes "٩", "０7").
_NUMBERED = re.compile(r"checkpoint_(0|[1-9][0-9]*)")
_TEMP = re.compile(r"\.(.+)\.(tmp|old|trash)-([0-9a-f]{32})(-node[0-9]+)?")


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
        if match and _real_dir(os.path.join(root, name)):  # a symbolic link is never taken (nor deleted through)
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def _real_dir(path: str) -> bool:
    """A directory that is not a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def next_number(root: str, iteration: int) -> int:
    """The number of the next automatic checkpoint: ``iteration``, but never one already taken."""
    # every name in use counts, links and other libraries' folders included: never written over
    taken = [int(m.group(1)) for m in map(_NUMBERED.fullmatch, os.listdir(root) if os.path.isdir(root) else []) if m]
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
def manifest_checksum(manifest: dict[str, Any]) -> str:
    """The manifest's own checksum: SHA-256 of its canonical JSON without the checksum field, so a
    damaged manifest is reported as such instead of as missing or wrong files."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def _read_text(folder: str, name: str = MANIFEST) -> str:
    """The manifest's text, read from a plain file inside ``folder`` (``files.paths.open_inside``)."""
    return read_inside(folder, name, "manifest").decode("utf-8")


def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest of ``folder`` after checking that the folder is complete; raises otherwise.

    Checked in this order: the folder and ``manifest.json`` are real (no symbolic links); the JSON
    parses; format and version; every listed name stays inside the folder and is no link; the
    manifest's own checksum; every listed file is present with its recorded size.
    """
    path = os.path.join(folder, MANIFEST)
    if is_link(folder):
        raise IncompleteCheckpointError(
            f"{folder!r} is a symbolic link; hasten reads checkpoints only from real folders (a link may lead "
            f"anywhere); pass the folder it points to ({os.path.realpath(folder)!r}) if you trust it"
        )
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"checkpoint folder {folder!r} does not exist")
    if is_link(path):
        raise IncompleteCheckpointError(f"{path!r} is a symbolic link; the checkpoint is damaged or crafted "
                                        "(nothing was read)")
    if not os.path.isfile(path):
        raise IncompleteCheckpointError(
            f"{folder!r} has no {MANIFEST}: it is not a complete hasten checkpoint (an interrupted save, or a "
            "checkpoint written by another library); pass a folder written by hasten's save_state"
        )
    try:
        manifest = json.loads(_read_text(folder))
    except UnsafeFileError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise DamagedManifestError(
            f"{path!r} is damaged: it cannot be read as JSON ({type(e).__name__}: {e}); the checkpoint cannot be "
            "trusted, load an earlier one"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IncompleteCheckpointError(f"{path!r} is not a hasten checkpoint manifest")
    version = manifest.get("format_version")
    if type(version) is not int or version not in _READABLE_VERSIONS:
        raise IncompleteCheckpointError(
            f"{folder!r} has checkpoint format version {version!r}, but this hasten reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}; "
            + ("upgrade hasten to load it" if isinstance(version, int) and version > FORMAT_VERSION
               else "re-save it with this hasten's save_state")
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise DamagedManifestError(f"{path!r} is damaged: it lists no files")
    outside = [(name, why) for name in files for why in [why_outside(folder, name)] if why]
    if outside:
        raise IncompleteCheckpointError(
            f"{path!r} names files outside the checkpoint folder {folder!r}: "
            + ", ".join(f"{name!r} ({why})" for name, why in outside[:5])
            + "; a manifest written by save_state only names real files inside it, so this one is damaged or "
            "crafted (nothing was read)"
        )
    recorded = manifest.get(CHECKSUM_KEY)
    try:
        found = manifest_checksum(manifest)
    except ValueError:
        found = None
    if recorded != found and (version >= 2 or recorded is not None):
        raise DamagedManifestError(
            f"{path!r} is damaged: "
            + (f"its checksum {recorded!r} does not match its content ({found})" if recorded
               else "it has no checksum of its own (hasten writes one)")
            + "; the checkpoint cannot be trusted, load an earlier one"
        )
    damaged = [name for name, info in files.items() if not isinstance(info, dict) or not isinstance(info.get("size"), int)]
    if damaged:
        raise DamagedManifestError(f"{path!r} is damaged: no size for {damaged[:5]}")
    # Version 2 records every file's checksum (the commit computes any a writer left out): a manifest
    # without one would let its file load unverified.
    unchecked = [name for name, info in files.items() if version >= 2 and not isinstance(info.get("checksum"), str)]
    if unchecked:
        raise DamagedManifestError(f"{path!r} is damaged or crafted: no checksum for {unchecked[:5]}")
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


def read_full_manifest(folder: str) -> dict[str, Any]:
    """``read_manifest``, and every field that ``load_state`` reads is there with the right type
    (tools that read only the model list, like merge-weights, use ``read_manifest``)."""
    manifest = read_manifest(folder)
    problem = _structure_problem(manifest)
    if problem:
        raise DamagedManifestError(f"{os.path.join(folder, MANIFEST)!r} is damaged or crafted: {problem}")
    return manifest


_INTS = ("world_size", "iteration", "step", "gradient_accumulation_steps")
_LISTS = ("models", "optimizers", "schedulers", "dataloaders", "custom_objects")


def _structure_problem(manifest: dict[str, Any]) -> Optional[str]:
    """What the loaders would trip over in a manifest whose checksum matches (one crafted, or written
    by a buggy tool), as one sentence; None when its shape is what save_state writes."""
    for key in _INTS:
        if type(manifest.get(key)) is not int or manifest[key] < (1 if key != "iteration" and key != "step" else 0):
            return f"{key!r} is {manifest.get(key)!r}, not a valid count"
    if type(manifest.get("mid_accumulation")) is not bool:
        return "'mid_accumulation' is not true or false"
    contents = manifest.get("contents")
    if not isinstance(contents, dict):
        return "it has no 'contents'"
    for key in _LISTS:
        entries = contents.get(key)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            return f"'contents.{key}' is not a list of entries"
        for entry in entries:
            name = entry.get("file")
            if name is not None and not isinstance(name, str):
                return f"'contents.{key}' names {name!r} as a file"
            # models and optimizers may live in a backend's files instead (their entry says which)
            if key in ("schedulers", "custom_objects") and name not in manifest["files"]:
                return f"'contents.{key}' names {name!r}, which is not among its files"
    scaler = contents.get("scaler")
    if scaler is not None and (not isinstance(scaler, str) or scaler not in manifest["files"]):
        return f"'contents.scaler' names {scaler!r}, which is not among its files"
    return None


def _inside(folder: str, name: Any) -> bool:
    """Whether the manifest's file ``name`` stays inside ``folder`` (``files.paths.why_outside``)."""
    return why_outside(folder, name) is None


def is_complete(folder: str) -> bool:
    try:
        read_manifest(folder)
    except (IncompleteCheckpointError, CheckpointNotFoundError, CheckpointCorruptError, OSError):
        return False
    return True


def newest_complete(root: str, skipped: Optional[list] = None) -> Optional[tuple[int, str]]:
    """``(N, path)`` of the complete checkpoint with the highest number in ``root``, if any.

    ``skipped``: gets ``"path: why"`` for each newer numbered folder passed over (damaged, incomplete,
    not hasten's), for the caller to warn about: a fallback to an older checkpoint must not be silent.
    """
    for number, path in reversed(numbered(root)):
        try:
            read_manifest(path)
        except (IncompleteCheckpointError, CheckpointNotFoundError, CheckpointCorruptError, OSError) as e:
            if skipped is not None:
                skipped.append(f"{path}: {e}")
            continue
        return number, path
    return None


def warn_skipped(skipped: list[str]) -> None:
    """Warn that discovery passed over newer folders (``newest_complete``'s ``skipped``)."""
    if skipped:
        import warnings

        warnings.warn("passed over newer checkpoint folders that are not complete hasten checkpoints (damaged, "
                      "interrupted, or not hasten's):\n  - " + "\n  - ".join(skipped), HastenWarning, stacklevel=3)


def write_manifest(folder: str, manifest: dict[str, Any], name: str = MANIFEST) -> None:
    """Write ``manifest`` with its own checksum as ``name`` (``manifest.json``; an attachment record of
    ``solo``) into ``folder`` (temp file, fsync, rename). The folder is fsynced once, by the caller,
    right after: each fsync costs a device cache flush, even with nothing to write."""
    manifest = dict(manifest)
    manifest.pop(CHECKSUM_KEY, None)
    manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
    with atomic_path(os.path.join(folder, name), sync_folder=False) as temp:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True, allow_nan=False)
            f.write("\n")


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
    and make the rename durable. ``temp``'s own entries must be durable already (``fsync_path``).

    If the rename cannot be made durable (the directory's fsync fails), it is undone before the
    error is raised: the old checkpoint is back under ``target`` and the new one under ``temp``.
    """
    parent = os.path.dirname(target)
    if os.path.lexists(target):
        if _real_dir(target) and not os.listdir(target):
            os.rmdir(target)
        elif not (_real_dir(target) and os.path.isfile(os.path.join(target, MANIFEST))):
            raise FileExistsError(
                f"save_state: {target!r} exists and is not a hasten checkpoint; hasten replaces only its own "
                "checkpoints, so pick another output_dir or remove it"
            )
    if not os.path.lexists(target):
        os.rename(temp, target)
        _durable(parent, undo=lambda: os.rename(target, temp))
        return
    if _exchange(temp, target):  # temp now holds the old checkpoint
        _durable(parent, undo=lambda: _exchange(temp, target))
        remove_tree(temp, token, background=True)
        return
    # No atomic swap here: move the old one aside first. A crash between the renames leaves the new
    # checkpoint complete under its temporary name and the old one under ".old-"; ``recover`` (run
    # by discovery, load_state and save_state) renames the new one back into place.
    old = temp_path(target, token, "old")
    os.rename(target, old)
    try:
        os.rename(temp, target)
    except OSError:
        os.rename(old, target)
        raise

    def undo() -> None:
        os.rename(target, temp)
        os.rename(old, target)

    _durable(parent, undo)
    shutil.rmtree(old, ignore_errors=True)


def _durable(parent: str, undo: Callable[[], Any]) -> None:
    """fsync ``parent`` after a rename; on failure undo the rename, then raise."""
    try:
        fsync_path(parent)
    except OSError:
        try:
            undo()
        except OSError:
            pass
        raise


def recover(target: str) -> Optional[str]:
    """Put back a complete checkpoint that a crash left under a temporary name of ``target``.

    Only when ``target`` is missing and an ``.old-`` copy shows that a replace was under way (a crash
    between the two renames of a replace without atomic exchange: the committed checkpoint moved
    aside, the new one complete beside it). The newest wins: the complete ``.tmp-`` folder (its
    manifest is written last, so it is a finished save) over the ``.old-`` one. A lone ``.tmp-``
    folder is a save that never committed: it stays a leftover, as after any interrupted save.
    Returns the recovered path, or None.
    """
    if os.path.lexists(target):
        return None
    found = find_leftover(target)
    if not any(_TEMP.fullmatch(os.path.basename(p)).group(2) == "old" for p in found):
        return None
    found.sort(key=lambda p: (_TEMP.fullmatch(os.path.basename(p)).group(2) != "tmp", -os.path.getmtime(p)))
    for path in found:
        try:
            os.rename(path, target)
        except OSError:
            continue
        fsync_path(os.path.dirname(target))
        return target
    return None


def recover_all(root: str) -> list[str]:
    """``recover`` every automatically named checkpoint in ``root`` that left only hidden copies."""
    if not os.path.isdir(root):
        return []
    names = set()
    for entry in os.listdir(root):
        match = _TEMP.fullmatch(entry)
        if match and match.group(2) in ("tmp", "old") and not match.group(4) and automatic_name(match.group(1)):
            names.add(match.group(1))
    return [p for p in (recover(os.path.join(root, n)) for n in sorted(names)) if p]


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

    Runs only after ``keep`` is committed, and does nothing unless ``keep`` is complete (so retention
    never leaves fewer complete checkpoints than it found without a newer one in their place).
    Only hasten's folders count (a manifest of our format, complete or not), as they sort (by N);
    another library's ``checkpoint_N`` and symbolic links are never counted nor deleted (through).
    Returns the deleted paths.
    """
    if total_limit is None or not is_complete(keep):
        return []
    folders = [(n, p) for n, p in numbered(root) if _ours(p)]
    excess = len(folders) - total_limit
    deleted = []
    keep = os.path.abspath(keep)
    keep_number = next((n for n, p in folders if os.path.abspath(p) == keep), None)
    for number, path in folders:
        if excess <= 0:
            break
        if os.path.abspath(path) == keep or (keep_number is not None and number > keep_number):
            continue
        remove_tree(path, background=True)
        deleted.append(path)
        excess -= 1
    return deleted


def _ours(folder: str) -> bool:
    """Whether ``folder`` was written by hasten's save_state: its manifest (a real file) says our format."""
    try:
        return json.loads(_read_text(folder)).get("format") == FORMAT  # never through a link
    except (OSError, ValueError, RecursionError, AttributeError):
        return False


def clean_leftovers(parent: str, keep: str, ours: Callable[[str], bool]) -> list[str]:
    """Remove temporary, trash and old folders left in ``parent`` by interrupted saves/deletions.

    ``keep``: the token of the save in progress. ``ours(name)``: whether a leftover for the
    checkpoint called ``name`` belongs to this run; others are left alone, since another job
    saving beside ours (a sweep writing ``runs/a`` and ``runs/b``) may be writing them right now.
    A complete leftover whose checkpoint is missing is put back (``recover``), never deleted.
    """
    removed = []
    if not os.path.isdir(parent):
        return removed
    for name in os.listdir(parent):
        match = _TEMP.fullmatch(name)
        if not match or match.group(3) == keep or not ours(match.group(1)):
            continue
        path = os.path.join(parent, name)
        if not _real_dir(path):
            continue
        if not match.group(4) and recover(os.path.join(parent, match.group(1))):
            continue  # it was this one (or a newer copy) that came back; the rest is removed next time
        if not os.path.lexists(path):
            continue
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
        if match and match.group(1) == name and match.group(2) in ("tmp", "old") and not match.group(4):
            path = os.path.join(parent, entry)
            if _real_dir(path) and is_complete(path):
                out.append(path)
    return out
