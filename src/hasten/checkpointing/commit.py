"""The commit protocol of a checkpoint save, top to bottom in ``write_and_commit``.

``save_state`` (``mixin``) decides what to save and where; this module makes it a checkpoint. Every
process runs ``write_and_commit``; one of them writes the shared files and commits (process 0, or
each node's first process with ``save_on_each_node``). The steps, in order:

1. write: every process writes its files into the temporary folder, each fsynced by its writer;
2. exchange: every process learns every other's outcome and file list, so one failure is everyone's;
3. sharded write: with a DCP backend, the collective write of models/optimizers, then its outcomes;
4. record: the committing process checks that every listed file is visible to it and lists, with
   sizes and checksums, the sharded files and those the save hooks wrote (fsyncing the latter);
5. durable: it fsyncs the subfolders, writes ``manifest.json`` last (itself fsynced) and fsyncs the
   folder, so every entry is on disk before the folder can appear under its final name;
6. rename: it moves the folder into place atomically (an older checkpoint there is swapped out);
7. retention: it deletes checkpoints beyond ``total_limit`` (never the new one) and leftovers of
   this run's interrupted saves;
8. agree: every process learns whether the commit worked, so all raise the same error or none.

On a failure before the rename (an fsync error included: only "not supported" errnos are ignored)
the committing process removes the temporary folder: nothing is committed; a rename that cannot be
made durable is undone first (``layout.move_into_place``). ``layout`` (names, manifest file, atomic rename, removal) and ``saver``/``files``
(writing files) are the leaves it calls; none of them calls back here.

``write_and_commit`` runs either inline (``save_state()``) or on a background thread
(``save_state(blocking=False)``). The background variant first copies every tensor into staging
buffers (``staging.Stager``), so training may change the live state while the files are written, and it
talks to the other processes over a process group of its own: collectives of the training loop
on the default group and those of the save never interleave.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from ..group_lifetime import release_save_group, save_group  # noqa: F401 - the save's group, here for callers
from ..files.durable import fsync_path
from ..files.reading import file_checksum
from . import layout, saver
from .collectives import ProcessGroupGone, gather
from .staging import Stager


def raise_if_any(results: list, kind: type, head: str) -> None:
    problems = [p for r in results for p in (r or [])]
    if problems:
        unique = list(dict.fromkeys(problems))
        raise kind(head + "\n  - " + "\n  - ".join(unique))


def agree(problem: Optional[str], head: str, group: Any = None, share: Any = None) -> list:
    """Raise ``RuntimeError(head + every process's problem)`` on every process if any process has one.

    A collective that every process reaches whatever failed on it (``problem``: this process's
    message, None when all went well), placed before the next collective a failed process would
    otherwise skip: one lone raise would leave the others waiting, or mismatch their collectives.
    Returns every process's ``share``, in rank order: a small value the caller needs from all
    processes rides along instead of costing a collective of its own.
    """
    answers = gather((problem, share), group)
    raise_if_any([[p] if p else [] for p, _ in answers], RuntimeError, head)
    return [value for _, value in answers]


@dataclass
class SaveJob:
    """Where one process writes and what the committing process records; fixed when the save starts."""

    folder: str
    target: str
    token: str
    number: Optional[int]
    rank: int
    world_size: int
    node: int
    writes_shared: bool
    manifest: dict[str, Any]  # everything but the file list
    total_limit: Optional[int]
    sharded: Optional[Callable[[], None]] = None  # collective DCP write of models/optimizers (every process)
    listing: Optional[Callable[[str], dict]] = None  # manifest records of the files ``sharded`` wrote


def write_and_commit(job: SaveJob, prepared: tuple, group: Any = None) -> None:
    """Run the commit protocol (the module's steps 1 to 8) for ``prepared``, this process's files
    as ``("ok", items)``, or ``("error", message)`` when preparing them failed.

    Every process learns every other's outcome, so all of them raise the same error or none does.
    """
    # 1. write
    try:
        if prepared[0] == "ok":
            writer = saver.Writer(job.folder, job.rank)
            for item in prepared[1]:
                writer.write(item)
            result = ("ok", writer.files, job.node)
        else:
            result = ("error", prepared[1], job.node)
    except Exception as e:  # noqa: BLE001 - every process must learn that the save failed
        result = ("error", f"process {job.rank}: {type(e).__name__}: {e}", job.node)
    # 2. exchange
    try:
        results = gather(result, group, job.world_size)
    except ProcessGroupGone:
        if job.writes_shared:
            layout.remove_tree(job.folder)
        raise
    errors = [r[1] for r in results if r[0] == "error"]
    # 3. sharded write, once every process knows that every process is ready
    checksums: dict[str, str] = {}  # of the files the sharded write made, from the processes that wrote them
    if job.sharded is not None and not errors:
        outcome: tuple = (None, {})
        try:
            outcome = (None, job.sharded() or {})
        except Exception as e:  # noqa: BLE001 - DCP raises on every process when one fails
            outcome = (f"process {job.rank}: {type(e).__name__}: {e}", {})
        outcomes = gather(outcome, group)
        errors = [failure for failure, _ in outcomes if failure]
        checksums = {name: value for _, written in outcomes for name, value in written.items()}
    # 4. to 7. on the committing process; a failure removes the temporary folder
    status = None
    if job.writes_shared:
        if errors:
            layout.remove_tree(job.folder)
        else:
            mine = [files for _, files, node in results if node == job.node]  # a folder per node: that node's
            status = _commit(job, mine, checksums)
    # 8. agree
    statuses = gather(status, group, job.world_size)
    if errors:
        raise RuntimeError("save_state failed; nothing was committed:\n  - " + "\n  - ".join(errors))
    raise_if_any([[s] if s else [] for s in statuses], RuntimeError, "save_state could not commit the checkpoint:")


def commit_alone(job: SaveJob, items: list) -> None:
    """The protocol on process 0 alone, for a save no other process takes part in (``solo``): step 1
    for its own files, then steps 4 to 7, without any exchange. Raises as ``write_and_commit`` does;
    nothing is committed on a failure."""
    try:
        writer = saver.Writer(job.folder, job.rank)
        for item in items:
            writer.write(item)
    except Exception as e:  # noqa: BLE001 - reported as every save failure is
        layout.remove_tree(job.folder)
        raise RuntimeError(f"save_state failed; nothing was committed:\n  - process {job.rank}: "
                           f"{type(e).__name__}: {e}") from e
    status = _commit(job, [writer.files], {})
    if status:
        raise RuntimeError(f"save_state could not commit the checkpoint:\n  - {status}")


def _commit(job: SaveJob, listed_by_process: list, checksums: dict[str, str]) -> Optional[str]:
    """Steps 4 to 7 on the committing process; returns what went wrong, or None."""
    folder, parent = job.folder, os.path.dirname(job.target)
    try:
        # 4. record
        files: dict[str, Any] = {}
        for listed in listed_by_process:
            for name, info in listed.items():
                if name in files:
                    raise RuntimeError(f"two processes wrote {name!r}")
                files[name] = info
        copy_links(folder)  # a save hook may have linked a file in: the checkpoint stores its bytes
        here = layout.files_in(folder)
        absent = [n for n in files if n not in here]
        if absent:
            raise RuntimeError(
                f"files written by other processes are not visible to the committing process: {absent[:5]}; the "
                "checkpoint folder is not on a filesystem shared by all processes (use "
                "ProjectConfiguration(save_on_each_node=True))"
            )
        if job.sharded is not None:
            from .sharded import files as sharded_files

            sharded = (job.listing or sharded_files)(folder)  # fsynced by the processes that wrote them
            for name, info in sharded.items():  # a file no process claimed is checksummed here
                info["checksum"] = checksums.get(name) or file_checksum(os.path.join(folder, name))
            files.update(sharded)
        for name in here:  # written by save hooks: make them durable and record them too
            if name not in files:
                full = os.path.join(folder, name)
                fsync_path(full)
                files[name] = {"size": os.path.getsize(full), "checksum": file_checksum(full), "rank": "hook"}
        # 5. durable: subfolders, then the manifest, then the folder's own entries (the manifest's last)
        for sub in {os.path.dirname(n) for n in here if os.path.dirname(n)}:
            fsync_path(os.path.join(folder, sub))
        layout.write_manifest(folder, dict(job.manifest, files=files))
        fsync_path(folder)
        # 6. rename
        layout.move_into_place(folder, job.target, job.token)
        # 7. retention
        if job.number is not None:
            layout.apply_total_limit(parent, job.total_limit, keep=job.target)
        name = os.path.basename(job.target)
        ours = layout.automatic_name if job.number is not None else (lambda other: other == name)
        layout.clean_leftovers(parent, job.token, ours)
    except Exception as e:  # noqa: BLE001
        layout.remove_tree(folder)
        return f"{type(e).__name__}: {e}"
    return None


def copy_links(folder: str) -> None:
    """Replace every symbolic link under ``folder`` (a save hook's: hasten's writers make none) by a copy of
    the regular file it points to, so the checkpoint stores what ``load_state`` can read (it refuses links);
    raise ``RuntimeError`` naming the link for one that is dangling or points at a folder or at anything but
    a regular file, before anything is committed. Other entries that are not regular files are refused too."""
    import stat

    for directory, folders, names in os.walk(folder):
        for name in folders + names:
            path = os.path.join(directory, name)
            shown = os.path.relpath(path, folder)
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode) or (stat.S_ISREG(mode) and name in names):
                continue
            if not stat.S_ISLNK(mode):
                raise RuntimeError(f"{shown!r} in the checkpoint folder is not a regular file (a save hook made it); "
                                   "a checkpoint holds regular files and folders only: write the file's bytes")
            target = os.readlink(path)
            try:  # O_NONBLOCK: a link to a FIFO must not block the save (it is refused below)
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            except OSError as e:
                raise RuntimeError(f"{shown!r} in the checkpoint folder is a symbolic link to {target!r}, which cannot "
                                   f"be read ({e.strerror or e}); save hooks must write files (or link existing "
                                   "regular files, which the checkpoint stores as copies)") from None
            kind = os.fstat(fd).st_mode
            if not stat.S_ISREG(kind):
                os.close(fd)
                what = "a folder" if stat.S_ISDIR(kind) else "something that is not a regular file"
                raise RuntimeError(f"{shown!r} in the checkpoint folder is a symbolic link to {target!r}, {what}; a "
                                   "checkpoint stores regular files only: copy the files into the folder in the save "
                                   "hook")
            with os.fdopen(fd, "rb") as source:
                copy = os.path.join(directory, f".{name}.copy-{layout.new_token()}")
                with open(copy, "xb") as out:
                    while chunk := source.read(8 << 20):
                        out.write(chunk)
            os.replace(copy, path)  # the link's name now holds the bytes it pointed at


class Background:
    """At most one save running on a thread; its failure is raised by the next ``wait``.

    Every instance is known to ``wait_all``, which whatever ends the script (``hasten launch``'s
    bootstrap, ``notebook_launcher``'s child, ``destroy_process_group``) calls before the process
    group goes: the save's exchanges need the group.
    """

    def __init__(self) -> None:
        self.thread: Optional[threading.Thread] = None
        self.target: Optional[str] = None
        self.error: Optional[BaseException] = None
        self.stager = Stager()
        _ALL.add(self)

    def start(self, target: str, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - kept for the caller's next wait()
                self.error = e
                from ..logging import get_logger

                get_logger(__name__).warning("background save to %s: %s", target, e,
                                             main_process_only=False)

        _report_failures_at_exit()
        self.target, self.error = target, None
        # Not a daemon: an interpreter that is exiting waits for the commit instead of abandoning it.
        self.thread = threading.Thread(target=run, name="hasten-checkpoint-save")
        self.stager.reader = self.thread  # the next staging waits for it before reusing the buffers
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"background save to {self.target}: {error}") from error


_ALL: "weakref.WeakSet[Background]" = weakref.WeakSet()
_AT_EXIT: list = []


def wait_all() -> None:
    """Wait for every background save of this process and release their group (whatever calls
    this ends the script); raise the first failure not reported yet."""
    first: Optional[BaseException] = None
    for background in list(_ALL):
        try:
            background.wait()
        except RuntimeError as e:
            first = first or e
    release_save_group()
    if first is not None:
        raise first


def _report_failures_at_exit() -> None:
    """A script that ends without waiting (plain ``python``, ``torchrun``): the interpreter joins
    the save thread, then this reports a failed save and makes the exit status say so, instead of
    a warning in the log and status 0 with the checkpoint missing."""
    if _AT_EXIT:
        return
    _AT_EXIT.append(True)

    def check() -> None:
        try:
            wait_all()
        except RuntimeError as e:
            import sys

            sys.stderr.write(f"hasten: the last checkpoint was not saved: {e}\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)

    atexit.register(check)
