"""Whole lines from every process of a job (loaded by ``_bootstrap.py``; standard library only).

The processes run unbuffered (``python -u``), so ``print(a, b)`` reaches the file as four writes
(``a``, the space, ``b``, the newline), and two processes sharing a terminal or a pipe interleave
them mid-line: ``...PASS (0/52 stale)DEFECT prepare_loop rank=1: PASS...``. :func:`install` puts
a binary layer under ``sys.stdout`` and ``sys.stderr`` that hands the OS complete lines only: the
lines a write completes go out in one ``os.write`` (split at line ends into pieces of at most
``PIPE_BUF`` bytes, the size a pipe writes without interleaving; a terminal or a file takes any
size whole), and the text after the last newline waits for its newline. It still goes out
promptly: on ``flush()`` (``print(..., flush=True)``, progress bars, ``input()``), after
``PARTIAL_DELAY_S`` without its newline (a prompt, ``print(..., end="")``), once it reaches
``PIPE_BUF`` bytes, and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import select
import sys
import threading
import time
import weakref
from typing import Optional

PARTIAL_DELAY_S = 0.2  # a line without its newline is shown after this long
LOCK_WAIT_S = 1.0  # longer: the holder is a daemon thread the interpreter's exit froze; write anyway
PIPE_BUF = getattr(select, "PIPE_BUF", 512)  # POSIX guarantees 512


class LineWriter(io.RawIOBase):
    """A binary stream on file descriptor ``fd`` that writes whole lines (the fd is never closed)."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self._fd, self._name = fd, name
        self._tail = b""  # text after the last newline, not written yet
        self._since = 0.0  # when the tail started
        self._lock = threading.RLock()  # re-entrant: a signal handler may print while a write runs
        _WRITERS.add(self)

    @property
    def name(self) -> str:
        return self._name

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def writable(self) -> bool:
        return True

    @contextlib.contextmanager
    def _held(self):
        got = self._lock.acquire(timeout=LOCK_WAIT_S)
        try:
            yield
        finally:
            if got:
                self._lock.release()

    def write(self, data) -> int:  # type: ignore[override]
        data = bytes(data)
        got = self._lock.acquire(True, LOCK_WAIT_S)  # not _held(): this is the hot path
        try:
            pending = self._tail + data
            end = pending.rfind(b"\n") + 1
            if len(pending) - end >= PIPE_BUF:  # an unfinished line this long cannot go out whole anyway
                end = len(pending)
            if end or not self._tail:
                self._since = time.monotonic()  # when the (new) unfinished line began
            self._tail = pending[end:]
            if end:
                self._emit(pending[:end])
        finally:
            if got:
                self._lock.release()
        if self._tail:
            _FLUSHER.remind()
        return len(data)

    def flush(self) -> None:
        with self._held():
            tail, self._tail = self._tail, b""
            if tail:
                self._emit(tail)

    def flush_if_older(self, age_s: float) -> bool:
        """Write the unfinished line if it waited ``age_s``; True when one is still waiting."""
        with self._held():
            if self._tail and time.monotonic() - self._since >= age_s:
                self.flush()
            return bool(self._tail)

    def close(self) -> None:
        if not self.closed:
            try:
                self.flush()
            finally:
                super().close()

    def _emit(self, data: bytes) -> None:
        while data:
            piece = data
            if len(data) > PIPE_BUF:  # as many whole lines as one atomic pipe write holds, else one long line
                cut = data.rfind(b"\n", 0, PIPE_BUF) + 1 or data.find(b"\n") + 1 or len(data)
                piece = data[:cut]
            view = memoryview(piece)
            while view:
                view = view[os.write(self._fd, view):]
            data = data[len(piece):]

    def _after_fork(self) -> None:
        self._lock = threading.RLock()
        self._tail = b""  # the parent writes its own unfinished line


class _Flusher:
    """One daemon thread that shows unfinished lines after ``PARTIAL_DELAY_S``; it sleeps until a
    write leaves one (most output is whole lines and never wakes it)."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def remind(self) -> None:
        if self._wake.is_set():
            return
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="hasten-line-flusher", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            waiting = True
            while waiting and not self._stopped:
                time.sleep(PARTIAL_DELAY_S / 2)
                waiting = False
                for writer in list(_WRITERS) if not self._stopped else []:
                    try:
                        waiting = writer.flush_if_older(PARTIAL_DELAY_S) or waiting
                    except (OSError, ValueError):
                        pass  # a closed stream: nothing to show

    def stop(self) -> None:
        """At exit, before the interpreter freezes daemon threads (maybe holding a writer's lock):
        no more background writes; the interpreter's own final flush writes what is left."""
        self._stopped = True

    def _after_fork(self) -> None:
        self._wake = threading.Event()
        self._thread = None  # threads do not survive fork; started again when needed


_WRITERS: "weakref.WeakSet[LineWriter]" = weakref.WeakSet()
_FLUSHER = _Flusher()


def _reset_after_fork() -> None:
    for writer in list(_WRITERS):
        writer._after_fork()
    _FLUSHER._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
atexit.register(_FLUSHER.stop)


def _wrap(stream, name: str):
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream  # not a file (replaced by the caller, or closed): leave it alone
    wrapped = io.TextIOWrapper(LineWriter(fd, name), encoding=stream.encoding, errors=stream.errors, newline="\n",
                               line_buffering=False, write_through=True)
    wrapped.mode = "w"
    return wrapped


def install() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` write whole lines (``sys.__stdout__`` stays the original)."""
    stdout, stderr = sys.stdout, sys.stderr
    if stdout is not None:
        stdout.flush()
        sys.stdout = _wrap(stdout, "<stdout>")
    if stderr is not None:
        stderr.flush()
        sys.stderr = _wrap(stderr, "<stderr>")
