"""Runs in every process that ``hasten launch`` starts, around the user's script or module.

``python -u _bootstrap.py [-m] target args...`` behaves like ``python target args`` (or ``-m``),
and in addition: when the script fails it writes a record (time, rank, host, traceback, whether
the error only echoes another rank's failure) to the file torch's elastic agent names in
``TORCHELASTIC_ERROR_FILE``, so that the launcher can name the rank that failed first; it asks
the kernel to stop this process if the launcher dies (no orphans); it starts the heartbeat
(``_heartbeat.py``) that the launcher's hang watchdog reads; and it makes ``sys.stdout`` and
``sys.stderr`` write whole lines (``_lines.py``), so that processes printing at once never glue
their text mid-line. Standard library only, and it must
not import the ``hasten`` package either: the script's imports start from a clean slate.
"""

import os
import sys

# Run as a file, Python put this file's folder first on sys.path; the script must see its own
# folder instead (set in main), never hasten/commands/ (a user's `import config` would find ours).
if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json  # noqa: E402
import re  # noqa: E402
import runpy  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

# An error whose message means "a peer went away": a consequence of another rank's failure.
_PEER_GONE = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|remote worker|remote process|"
    r"communicator was aborted|watchdog|socket timeout|timed out|connection refused|recvBytes|sendBytes",
    re.IGNORECASE,
)
_DIST_ERRORS = {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}


def is_peer_failure(exc: BaseException) -> bool:
    """True for errors that collectives raise when another process died or hung."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _DIST_ERRORS:
        return True
    return isinstance(exc, RuntimeError) and bool(_PEER_GONE.search(str(exc)))


def _skip_runner_frames(tb):
    """Drop this file's and runpy's frames so the traceback starts in the user's code."""
    mine = {os.path.abspath(__file__), runpy.__file__}
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name in mine or os.path.abspath(name) in mine or name.startswith("<frozen runpy"):
            tb = tb.tb_next
        else:
            break
    return tb


def _under_launcher() -> bool:
    """True when ``hasten launch``'s agent started this process: the launcher collects the records
    and prints the first failing rank's traceback itself, so this process does not print its own."""
    return bool(os.environ.get("HASTEN_FAILURE_DIR"))


def _restarts_left() -> bool:
    """The agent will start this job again after a failure (``--max_restarts`` not used up)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < int(
            os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False


def write_record(kind: str, summary: str, text: str = "", consequence: bool = False, exit_code: int = 1) -> None:
    """Leave the failure where the agent looks for it (torch's error-file format plus ours)."""
    now = time.time()
    data = {
        "message": {"message": summary, "extraInfo": {"py_callstack": text, "timestamp": str(int(now))}},
        "hasten": {
            "time": now, "kind": kind, "summary": summary, "traceback": text, "consequence": consequence,
            "exit_code": exit_code, "pid": os.getpid(), "host": socket.gethostname(),
            "rank": os.environ.get("RANK"), "local_rank": os.environ.get("LOCAL_RANK"),
            "node": os.environ.get("GROUP_RANK"), "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        },
    }
    # The agent's error file (torch's format) and our own folder, where the launcher finds every
    # rank's record even when the agent only reports one failed process.
    paths = [os.environ.get("TORCHELASTIC_ERROR_FILE")]
    folder = os.environ.get("HASTEN_FAILURE_DIR")
    if folder:
        paths.append(os.path.join(folder, f"rank{os.environ.get('RANK', os.getpid())}.json"))
    for path in filter(None, paths):
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError:
            pass  # reporting must never hide the original error
    if text and paths[0]:
        # The full traceback, readable, in this rank's folder of the agent's log folder (--log_dir):
        # the terminal shows only the first failing rank's.
        try:
            with open(os.path.join(os.path.dirname(paths[0]), "traceback.log"), "a") as f:
                f.write(text)
        except OSError:
            pass


def _sibling(name: str):
    """A module of this folder, loaded by path so that the ``hasten`` package stays unimported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_hasten{name}", os.path.join(os.path.dirname(
        os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start_heartbeat() -> None:
    """Under ``hasten launch`` with a hang timeout: the heartbeat thread (``_heartbeat.py``) and
    the SIGUSR1 stack dump."""
    global _HEARTBEAT
    folder = os.environ.get("HASTEN_HANG_DIR")
    if not folder:
        return
    _HEARTBEAT = _sibling("_heartbeat")
    _HEARTBEAT.start(folder)


_HEARTBEAT = None


def _wait_for_saves() -> None:
    """The script returned: a background save it left running needs the process group, which
    goes next; wait for it, and let its failure fail this rank (raised from here). Other threads
    are left to the interpreter's exit, as with ``python script.py`` (joining them here could wait
    forever on an idle thread pool that only the interpreter's exit shuts down)."""
    saves = sys.modules.get("hasten.checkpointing.commit")
    if saves is not None:
        saves.wait_all()


def _finish() -> None:
    """The script and its saves are done: tear the process group down now (leaving it to
    interpreter exit sometimes aborts in native code) and tell the launcher that this rank's work
    is complete."""
    if _HEARTBEAT is not None:
        _HEARTBEAT.finished()
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the script's work is done either way
        pass
    folder = os.environ.get("HASTEN_FAILURE_DIR")
    if folder:
        try:
            with open(os.path.join(folder, f"done{os.environ.get('RANK', os.getpid())}"), "w") as f:
                f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except OSError:
            pass


def _die_with_launcher() -> None:
    """Linux: get SIGTERM when the launcher process goes away, even if it was SIGKILLed."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    launcher = os.environ.get("HASTEN_LAUNCHER_PID")
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        os._exit(1)  # the launcher died before the request took effect


def _show_hasten_warnings() -> None:
    """Show hasten's own warnings (``HastenWarning``) as one line ``hasten: warning: ...``.

    Set here, in a process the launcher owns, never by the library: ``python script.py`` keeps
    Python's display. Only the display changes: Python applies the filters (``-W``,
    ``PYTHONWARNINGS``, ``warnings.filterwarnings``) before calling ``showwarning``, every other
    category goes to the display it replaces, and ``catch_warnings(record=True)`` (pytest) or
    ``logging.captureWarnings`` still take over as usual.
    """
    import warnings

    python_display = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        # By name: this file must not import the hasten package (see the module docstring).
        if not any(c.__name__ == "HastenWarning" and c.__module__.startswith("hasten") for c in category.__mro__):
            return python_display(message, category, filename, lineno, file, line)
        stream = sys.stderr if file is None else file
        if stream is None:
            return None
        try:
            stream.write(f"hasten: warning: {message}\n")
        except (OSError, ValueError):
            pass  # like Python's own display: a warning never fails the script
        return None

    warnings.showwarning = show


def _alias_accelerate() -> None:
    """``HASTEN_AS_ACCELERATE=1``: ``import accelerate`` gives hasten in this process (a library built on
    Accelerate runs unedited; ``hasten.as_accelerate``). The one case where this file imports hasten,
    because the user asked for it; the package root and that module are torch-free."""
    if os.environ.get("HASTEN_AS_ACCELERATE", "").strip().lower() in ("1", "true", "yes", "on"):
        from hasten.as_accelerate import install_as_accelerate

        install_as_accelerate()


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def main(argv: list) -> None:
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: _bootstrap.py [-m] script-or-module [args...]")
    target, args = argv[0], argv[1:]
    _die_with_launcher()
    _sibling("_lines").install()
    _show_hasten_warnings()
    _start_heartbeat()
    _alias_accelerate()
    sys.argv = [target, *args]
    if module:
        sys.path.insert(0, os.getcwd())
    elif os.path.isfile(target) and not _is_zip(target):
        # Like python itself: the script's folder, symbolic links resolved.
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
    try:
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
            if code not in (None, 0):
                status = code if isinstance(code, int) else 1
                summary = f"exited with status {code}" if isinstance(code, int) else str(code)
                write_record("exit", summary, "", False, status)
                raise
        _wait_for_saves()  # a failed background save fails the script (reported below)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        # Stopped (Ctrl-C, or the launcher passing on a signal): not a failure to record. Under the
        # launcher, which says in one line that the job was interrupted, stay silent; else show
        # where it stopped. Then end by SIGINT as Python itself would.
        import signal

        if not _under_launcher():
            traceback.print_exception(type(exc), exc, _skip_runner_frames(exc.__traceback__))
            sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BaseException as exc:  # noqa: BLE001 - report, then fail like Python does
        tb = _skip_runner_frames(exc.__traceback__)
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        parts = traceback.format_exception_only(type(exc), exc)
        notes = len(getattr(exc, "__notes__", None) or ())  # e.g. hasten's pipeline position: not the error itself
        summary = "".join(parts[:len(parts) - notes] if notes < len(parts) else parts).strip().splitlines()[-1]
        write_record("exception", summary, text, is_peer_failure(exc), 1)
        if _under_launcher() and _restarts_left():
            # The agent restarts the job and the launcher reports only the last attempt: one line here.
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            why = "its collective broke (another process failed)" if is_peer_failure(exc) else summary
            print(f"hasten: rank {os.environ.get('RANK')} failed in attempt {attempt + 1} (the job restarts): {why}",
                  file=sys.stderr, flush=True)
        elif not _under_launcher():
            exc.__traceback__ = tb  # some hooks (torch's rank-prefixing one) read it from the exception
            sys.excepthook(type(exc), exc, tb)
        sys.exit(1)
    _finish()


if __name__ == "__main__":
    main(sys.argv[1:])
