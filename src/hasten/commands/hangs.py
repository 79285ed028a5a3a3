"""The launcher's hang watchdog and straggler check (torch-free; runs beside torch's elastic agent).

Every process writes a heartbeat file once a second (``_heartbeat.py``): hasten's progress
counters, and where it is once they stall. The watchdog reads those files. It arms when the first
process enters a collective or makes a progress mark (before that every process works alone:
a slow start is never a hang), and fires when no process still
running has shown a sign of life (a progress mark, or its main thread moving to another line)
for the hang timeout. It then asks every process for its Python stack (SIGUSR1 -> faulthandler)
and torch's flight recorder, prints one report (who is in which collective, who is elsewhere),
and stops the job; the launcher exits with ``HANG_EXIT_STATUS``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any, Callable, Optional

from ..progress import FILE_IO

HANG_EXIT_STATUS = 124  # like GNU timeout: distinct from failures (1, the script's own) and signals (128+n)
DEFAULT_HANG_TIMEOUT = 300.0
CHECK_S = 1.0
DUMP_WAIT_S = 5.0
STRAGGLER_WINDOW_S = 10.0
STRAGGLER_RATIO = 3.0
STRAGGLER_MIN_GAP_S = 0.02  # below this, "3x slower" is noise of microsecond steps
FR_BUFFER = "2000"


def child_env(folder: str, device: str, environ: Optional[dict] = None) -> dict[str, str]:
    """Variables for the processes: where to beat, and torch's flight recorder (NCCL: dump on timeout)."""
    env = os.environ if environ is None else environ
    out = {"HASTEN_HANG_DIR": folder}
    wanted = {"TORCH_FR_BUFFER_SIZE": FR_BUFFER}
    if device == "cuda":
        wanted.update({
            "TORCH_NCCL_TRACE_BUFFER_SIZE": FR_BUFFER,  # the NCCL flight recorder
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # NCCL's own watchdog dumps it when a collective times out
            "TORCH_FR_DUMP_TEMP_FILE": os.path.join(folder, "nccl_trace_rank_"),
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(folder, "nccl_trace_rank_"),  # older torch's name
        })
    out.update({k: v for k, v in wanted.items() if k not in env})
    return out


def read_beats(folder: str) -> dict[int, dict]:
    beats: dict[int, dict] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return beats
    for name in names:
        if name.startswith("beat") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    beat = json.load(f)
                beats[int(beat["rank"])] = beat
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return beats


# -- the report ----------------------------------------------------------------------------------
def _active_collective(fr: Optional[dict]) -> Optional[dict]:
    """The first collective this process entered and has not finished, from its flight recorder."""
    if not fr:
        return None
    active = [e for e in fr.get("entries", []) if not e.get("retired") and e.get("state") != "completed"]
    return min(active, key=lambda e: e.get("collective_seq_id", 0)) if active else None


def _op_text(entry: dict) -> str:
    name = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    dtypes, sizes = entry.get("input_dtypes") or [], entry.get("input_sizes") or []
    shapes = ", ".join(f"{str(d).lower()}[{', '.join(map(str, s))}]" for d, s in zip(dtypes, sizes))
    return f"{name}({shapes})" if shapes else name


def _load_fr(beat: dict) -> Optional[dict]:
    path = beat.get("fr")
    if not path or str(path).startswith("error"):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _user_frame(at: dict) -> str:
    user = at.get("user")
    if not user:
        return ""
    text = f"{user['file']}:{user['line']} in {user['function']}"
    return text + (f": {user['code']}" if user.get("code") else "")


def describe_rank(beat: dict, idle_s: float, now: float) -> tuple[str, Optional[tuple[int, str]]]:
    """One line for a rank, and (collective number, op) when it is inside a collective."""
    at, where, fr = beat.get("at") or {}, beat.get("where"), _load_fr(beat)
    entry = _active_collective(fr)
    position = f"step {beat.get('steps', 0)}, batch {beat.get('batches', 0)}"
    if beat.get("done"):
        return f"rank {beat['rank']}: finished its script ({position})", None
    hasten_op = where if where not in (None, "dataloader", "backward") else None
    if entry is not None:
        seq = int(entry.get("collective_seq_id", 0))
        what = f"in collective #{seq} {_op_text(entry)}"
        via = f"hasten {hasten_op}" if hasten_op else (
            "backward: DDP's gradient all-reduce" if where == "backward" or at.get("autograd") else
            f"torch.distributed.{at['c10d']}" if at.get("c10d") else "")
        what += f" (from {via})" if via else ""
        found: Optional[tuple[int, str]] = (seq, _op_text(entry).split("(")[0])
    elif hasten_op:
        what, found = f"in hasten's {hasten_op}", None
    elif at.get("c10d"):
        what, found = f"in torch.distributed.{at['c10d']}", None
    elif where == "dataloader" or at.get("loader"):
        what, found = f"in the dataloader, fetching batch {beat.get('batches', 0) + 1}", None
    elif where == "backward" or at.get("autograd"):
        what, found = "in backward" + (" (DDP all-reduce)" if beat.get("ddp") else ""), None
    else:
        what, found = "elsewhere (not in a collective)", None
    frame = _user_frame(at)
    if beat.get("pipeline"):  # inside a pipelined model's schedule step: stage, schedule, action
        what += f", in {beat['pipeline']}"
    line = f"rank {beat['rank']} (pid {beat.get('pid')}): {position}: {what} for {idle_s:.0f} s" + (
        f"; at {frame}" if frame else "")
    silent = now - float(beat.get("beat_t", now))
    if silent > 3 * CHECK_S + 2:
        line += f" [no heartbeat for {silent:.0f} s: native code holding the GIL? see its stack]"
    return line, found


def diagnose(places: dict[int, Optional[tuple[int, str]]]) -> str:
    """What the ranks' positions say: a skipped collective, a rank left behind, a mismatch."""
    inside = {r: p for r, p in places.items() if p is not None}
    outside = sorted(r for r, p in places.items() if p is None)
    if not inside:
        return "no process is inside a collective: they all wait elsewhere (a deadlock in the script or data loading)"
    seqs = {p[0] for p in inside.values()}
    ops = {p[1] for p in inside.values()}
    if outside:
        waiting = ", ".join(map(str, sorted(inside)))
        return (f"rank(s) {waiting} wait in a collective for rank(s) {', '.join(map(str, outside))}, which never "
                "entered it (see where they are above)")
    if len(seqs) > 1 or len(ops) > 1:
        parts = ", ".join(f"rank {r} #{p[0]} {p[1]}" for r, p in sorted(inside.items()))
        return (f"the ranks are in different collectives ({parts}): one rank skipped or added a collective; "
                "look for one under `if accelerator.is_main_process:` or in a loop whose length differs per rank")
    return (f"every rank here is in collective #{seqs.pop()} {ops.pop()}: a peer on another machine is missing, "
            "or the inputs' sizes differ")


def build_report(beats: dict[int, dict], idle: dict[int, float], timeout: float, source: str, folder: str,
                 now: float) -> str:
    lines = [f"hasten: hang: no process made progress for {timeout:g} s (hang timeout, {source}); their Python "
             "stacks were dumped and the job was stopped"]
    places = {}
    for rank in sorted(beats):
        text, place = describe_rank(beats[rank], idle.get(rank, 0.0), now)
        lines.append("  " + text)
        if not beats[rank].get("done"):
            places[rank] = place
    lines.append(f"hasten: {diagnose(places)}")
    stacks = [os.path.join(folder, f"stack{r}.txt") for r in sorted(beats)]
    lines.append(f"hasten: Python stacks of every thread: {', '.join(stacks)}")
    kept = [str(r) for r, b in sorted(beats.items()) if not b.get("stack_signal", True)]
    if kept:
        lines.append(f"hasten: no stacks from rank {', '.join(kept)}: its script handles SIGUSR1 itself")
    recorders = [b["fr"] for _, b in sorted(beats.items()) if b.get("fr") and not str(b["fr"]).startswith("error")]
    if recorders:
        lines.append(f"hasten: torch flight recorder (collectives entered, with sizes): {', '.join(recorders)}")
    nccl = sorted(n for n in os.listdir(folder) if n.startswith("nccl_trace_rank_")) if os.path.isdir(folder) else []
    if nccl:
        lines.append(f"hasten: NCCL flight recorder dumps: {', '.join(os.path.join(folder, n) for n in nccl)}")
    return "\n".join(lines)


# -- the watchdog --------------------------------------------------------------------------------
class Watchdog:
    """Watches the heartbeat files in ``folder``; ``stop()`` is called once after a hang was reported."""

    def __init__(self, folder: str, timeout: float, source: str, processes: int, stop: Callable[[], None],
                 warn: Optional[Callable[[str], None]] = None) -> None:
        self.folder, self.timeout, self.source, self.processes = folder, timeout, source, processes
        self.stop = stop
        self.warn = warn or (lambda text: print(text, file=sys.stderr, flush=True))
        self.report: Optional[str] = None
        self._seen: dict[int, tuple[Any, float]] = {}  # rank -> (sign of life, when it last changed)
        self._armed_at: Optional[float] = None
        self._window: Optional[tuple[float, dict[int, dict]]] = None
        self._warned: set[int] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hasten-hang-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(CHECK_S):
            try:
                if self.check(time.monotonic()):
                    return
            except Exception as exc:  # noqa: BLE001 - a broken watchdog must not break the job
                self.warn(f"hasten: warning: the hang watchdog stopped ({type(exc).__name__}: {exc})")
                return

    def effective_timeout(self, beats: dict[int, dict]) -> tuple[float, str]:
        asked = [b["hang_timeout"] for b in beats.values() if b.get("hang_timeout") is not None]
        if asked:
            return max(asked), "set by the script"
        return self.timeout, self.source

    def check(self, now: float) -> bool:
        """One look at the heartbeats; True once a hang was reported."""
        beats = read_beats(self.folder)
        for rank, beat in beats.items():
            sign = (beat.get("pid"), beat.get("ticks"), beat.get("changes"))
            # a process waiting for the disk (a long fsync) is not hung: its clock stays at now
            if self._seen.get(rank, (None,))[0] != sign or beat.get("where") == FILE_IO:
                self._seen[rank] = (sign, now)
        if self._armed_at is None:
            if any(b.get("ticks", 0) > 0 or b.get("entered") for b in beats.values()):
                self._armed_at = now
            return False
        self._check_stragglers(beats, now)
        timeout, source = self.effective_timeout(beats)
        live = [r for r, b in beats.items() if not b.get("done")]
        if timeout <= 0 or not live:
            return False
        idle = {r: now - max(self._seen[r][1], self._armed_at) for r in live}
        quiet = min(idle.values())
        if len(beats) < self.processes:  # a process that never beat counts from the first mark
            quiet = min(quiet, now - self._armed_at)
        if quiet < timeout:
            return False
        report = self._collect(now, idle, timeout, source)
        if not self._closed.is_set():  # the job may have ended meanwhile
            self.report = report
            self.stop()
        return True

    def _collect(self, now: float, idle: dict[int, float], timeout: float, source: str) -> str:
        request = f"{now:.3f}"
        tmp = os.path.join(self.folder, "dump.tmp")
        with open(tmp, "w") as f:
            f.write(request)
        os.replace(tmp, os.path.join(self.folder, "dump"))
        beats = read_beats(self.folder)
        for beat in beats.values():
            pid = beat.get("pid")
            # never 0 (the whole process group); never a process whose script took SIGUSR1 for itself
            if not beat.get("done") and beat.get("stack_signal", True) and isinstance(pid, int) and pid > 0:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    pass
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline:
            beats = read_beats(self.folder)
            if all(b.get("dumped") == request or b.get("done") for b in beats.values()):
                break
            time.sleep(0.1)
        time.sleep(0.2)  # faulthandler writes from the signal handler; give it a moment to finish
        return build_report(beats, idle, timeout, source, self.folder, time.monotonic())

    def _check_stragglers(self, beats: dict[int, dict], now: float) -> None:
        if self._window is None:
            self._window = (now, beats)
            return
        start, base = self._window
        if now - start < STRAGGLER_WINDOW_S:
            return
        self._window = (now, beats)
        key = "steps" if all(b.get("steps", 0) > 0 for b in beats.values()) else "batches"
        own: dict[int, tuple[float, int]] = {}
        for rank, beat in beats.items():
            old = base.get(rank)
            if old is None or old.get("pid") != beat.get("pid") or beat.get("done"):
                continue
            steps = beat.get(key, 0) - old.get(key, 0)
            if steps >= 3:
                if beat.get("work_s") is not None and old.get("work_s") is not None:
                    work = beat["work_s"] - old["work_s"]  # timed by the device (CUDA): host time says little there
                else:
                    work = (beat["t"] - old["t"]) - (beat.get("sync_s", 0.0) - old.get("sync_s", 0.0))
                own[rank] = (max(work, 0.0) / steps, steps)
        if len(own) < 2:
            return
        for rank, (mine, steps) in own.items():
            others = statistics.median(v for r, (v, _) in own.items() if r != rank)
            if rank not in self._warned and mine > STRAGGLER_RATIO * others and mine - others > STRAGGLER_MIN_GAP_S:
                self._warned.add(rank)
                self.warn(f"hasten: warning: rank {rank} is a straggler: {_secs(mine)} of its own work per step "
                          f"vs {_secs(others)} on the other ranks (median; outside collectives and backward, "
                          f"over its last {steps} steps); the others wait for it at every synchronisation")


def _secs(value: float) -> str:
    return f"{value:.3f} s" if value >= 0.01 else f"{value * 1e3:.2f} ms"
