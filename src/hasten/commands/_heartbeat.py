"""The heartbeat of one training process, read by ``hasten launch``'s hang watchdog.

Loaded by ``_bootstrap.py`` (standard library only; it must not import the ``hasten`` package)
when the launcher sets ``HASTEN_HANG_DIR``. A daemon thread writes ``beat<rank>.json`` there once
a second: hasten's progress counters (``hasten.progress``, when the script imported hasten), a
count of changes of the main thread's innermost frame (a rank computing in Python is not hung),
whether it has entered a collective yet (torch's flight recorder, looked at only until then),
and, once the counters stall, where the main thread is (top user frame, torch.distributed call,
backward). ``SIGUSR1`` makes faulthandler write every thread's stack to ``stack<rank>.txt``, even
when native code holds the GIL (then a SIGUSR1 handler the script had set runs; one it sets later
wins, and the watchdog no longer sends the signal). When the launcher leaves a ``dump`` file, the thread also writes
torch's flight recorder (the collectives this process entered, with sizes) to ``fr<rank>.json``.
"""

from __future__ import annotations

import faulthandler
import json
import linecache
import os
import signal
import sys
import sysconfig
import threading
import time
from typing import Any, Optional

INTERVAL_S = 1.0
STALL_BEATS = 2  # beats without a progress mark before the thread describes where the process is

_STDLIB = tuple(os.path.realpath(p) + os.sep for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _package_dir(name: str) -> Optional[str]:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.realpath(path)) + os.sep if path else None


def _is_user_file(path: str, skip: tuple) -> bool:
    if path.startswith("<") or "site-packages" in path or "dist-packages" in path:
        return False
    real = os.path.realpath(path)
    return not real.startswith(_STDLIB) and not real.startswith(skip)


def _shown(path: str) -> str:
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith("..") else rel


def where_is(frame: Any) -> dict:
    """Where the main thread is: its top user frame, the torch.distributed call it is in, backward."""
    skip = tuple(p for p in (_HERE, _package_dir("hasten"), _package_dir("torch")) if p)
    user, c10d, autograd, loader = None, None, False, False
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        if path.endswith(os.path.join("torch", "distributed", "distributed_c10d.py")):
            c10d = code.co_name  # outermost wins: the function the script called
        elif os.path.join("torch", "autograd") in path:
            autograd = True
        elif os.path.join("torch", "utils", "data") in path:
            loader = True
        elif user is None and _is_user_file(path, skip):
            line = linecache.getline(path, frame.f_lineno).strip()
            user = {"file": _shown(path), "line": frame.f_lineno, "function": code.co_name, "code": line}
        frame = frame.f_back
    return {"user": user, "c10d": c10d, "autograd": autograd, "loader": loader}


def _flight_recorder(only_active: bool = False) -> Optional[bytes]:
    """torch's flight recorder as JSON, when a process group exists (NCCL's own recorder on GPUs)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    import torch  # already imported: torch.distributed is

    c10d = torch._C._distributed_c10d
    dump = None
    if uses_nccl(str(dist.get_backend())):
        dump = getattr(c10d, "_dump_nccl_trace_json", None)
    dump = dump or getattr(c10d, "_dump_fr_trace_json", None)
    return dump(includeCollectives=True, onlyActive=only_active) if dump else None


def uses_nccl(backend: str) -> bool:
    """Whether a process group's backend string names NCCL: ``"nccl"``, or one entry of a
    per-device list such as ``"cuda:nccl,cpu:gloo"`` (FSDP with CPU offload)."""
    return any(part.rpartition(":")[2].strip() == "nccl" for part in backend.split(","))


def entered_a_collective() -> bool:
    """Whether this process has entered any collective (finished or not) of any process group, by
    torch's flight recorder: also direct ``torch.distributed`` calls and DDP's set-up broadcasts,
    which carry no hasten progress mark. Setting up the process group is not a collective."""
    data = _flight_recorder()
    return bool(data) and bool(json.loads(data).get("entries"))


class Heartbeat:
    def __init__(self, folder: str, rank: str) -> None:
        self.folder, self.rank = folder, rank
        self.path = os.path.join(folder, f"beat{rank}.json")
        self.main_id = threading.get_ident()
        self.changes, self.last_frame, self.last_ticks, self.still = 0, None, None, 0
        self.dumped: Optional[str] = None
        self.entered = False  # a collective was entered (looked up until it is so; never once ticks move)
        self.done = False
        self.lock = threading.Lock()
        self.stacks = open(os.path.join(folder, f"stack{rank}.txt"), "w")  # noqa: SIM115 - lives with the process
        # A handler set before us (Python's) still runs after the dump. One the script sets later
        # replaces the dump: the beat then says so, and the watchdog leaves that process alone
        # (a script's SIGUSR1 often means "save and requeue").
        self.usr1 = signal.getsignal(signal.SIGUSR1)
        faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True, chain=callable(self.usr1))

    def start(self) -> None:
        threading.Thread(target=self._run, name="hasten-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the heartbeat must never disturb the script
                pass
            time.sleep(INTERVAL_S)

    def _request(self) -> Optional[str]:
        try:
            with open(os.path.join(self.folder, "dump")) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def beat(self, done: bool = False) -> None:
        with self.lock:
            self.done = self.done or done
            frame = sys._current_frames().get(self.main_id)
            here = (id(frame.f_code), frame.f_lineno) if frame is not None else None
            if here != self.last_frame:
                self.changes += 1
                self.last_frame = here
            progress = sys.modules.get("hasten.progress")
            record: dict[str, Any] = progress.snapshot() if progress is not None else {"ticks": 0}
            self.still = self.still + 1 if record["ticks"] == self.last_ticks else 0
            self.last_ticks = record["ticks"]
            record.setdefault("t", time.monotonic())  # hasten's clock (perf_counter) when it is there
            if not self.entered and not record["ticks"]:
                try:
                    self.entered = entered_a_collective()
                except Exception:  # noqa: BLE001 - no recorder: hasten's progress marks still arm the clock
                    self.entered = False
            record.update(rank=int(self.rank), pid=os.getpid(), changes=self.changes, done=self.done,
                          beat_t=time.monotonic(), entered=self.entered or record["ticks"] > 0)
            request = None if self.done else self._request()
            if frame is not None and (self.still >= STALL_BEATS or request):
                record["at"] = where_is(frame)
            del frame
            if request and request != self.dumped:
                record["fr"] = self._dump_recorder()
                self.dumped = request
            record["dumped"] = self.dumped
            record["stack_signal"] = signal.getsignal(signal.SIGUSR1) is self.usr1  # SIGUSR1 still dumps stacks
            _write_json(self.path, record)

    def _dump_recorder(self) -> Optional[str]:
        try:
            data = _flight_recorder()
        except Exception as exc:  # noqa: BLE001 - report why, carry on
            return f"error: {type(exc).__name__}: {exc}"
        if not data:
            return None
        path = os.path.join(self.folder, f"fr{self.rank}.json")
        with open(path, "wb") as f:
            f.write(data)
        return path


_BEAT: Optional[Heartbeat] = None


def start(folder: str) -> None:
    """Start beating (called by the bootstrap in the main thread, before the script runs)."""
    global _BEAT
    try:
        _BEAT = Heartbeat(folder, os.environ.get("RANK", "0"))
        _BEAT.beat()
        _BEAT.start()
    except (OSError, ValueError, RuntimeError):
        _BEAT = None  # no hang report for this process, but the script runs


def finished() -> None:
    """The script finished: tell the watchdog not to wait for this process."""
    if _BEAT is not None:
        try:
            _BEAT.beat(done=True)
        except Exception:  # noqa: BLE001
            pass
