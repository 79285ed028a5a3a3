"""Which process failed first, and a report that names it (torch-free; fed by the elastic agent).

A failed job usually shows several dead processes: the one that really failed, the ones whose
collectives broke because it was gone ("Connection closed by peer"), and the ones the agent
stopped. The first is what the user needs: ranked by (is it only an echo of another failure?,
time), it is the earliest process whose error is its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Optional

OOM_HINT = "often the out-of-memory killer; check `dmesg` or `journalctl -k` for 'Out of memory' and lower memory use"


@dataclass
class Failure:
    rank: int
    local_rank: int
    node: Optional[int]
    host: str
    pid: int
    exitcode: int
    time: float
    summary: str
    traceback: str = ""
    consequence: bool = False
    # A signal that stopped the process after it had already failed on its own (while exiting):
    # the failure is the exception, not the signal.
    then_signal: Optional[str] = None

    @property
    def signal_name(self) -> Optional[str]:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def where(self) -> str:
        node = "?" if self.node is None else self.node
        return f"local rank {self.local_rank} on node {node}, host {self.host}, pid {self.pid}"

    def what(self, with_summary: bool = True) -> str:
        """One phrase: how it ended."""
        name = self.signal_name
        if name == "SIGKILL":
            return f"was killed (SIGKILL) — {OOM_HINT}"
        if name in ("SIGTERM", "SIGINT", "SIGHUP"):
            return f"was stopped ({name})"
        if name:
            native = name in ("SIGSEGV", "SIGBUS", "SIGABRT")
            return f"was killed by {name}" + (" (a crash in native code)" if native else "")
        late = f" (then ended by {self.then_signal} while exiting)" if self.then_signal else ""
        return f"failed with exit code {self.exitcode}{late}" + (f": {self.summary}" if self.summary and with_summary
                                                                  else "")


def read_records(folder: Optional[str]) -> dict[int, dict]:
    """The records children wrote to ``HASTEN_FAILURE_DIR``, latest restart attempt only."""
    if not folder or not os.path.isdir(folder):
        return {}
    records: dict[int, dict] = {}
    for name in os.listdir(folder):
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                rec = json.load(f)["hasten"]
            records[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if records:
        last = max(int(r.get("attempt") or 0) for r in records.values())
        records = {k: r for k, r in records.items() if int(r.get("attempt") or 0) == last}
    return records


def _from_record(rank: int, rec: dict, exitcode: int, node: Optional[int], host: str, local_rank: Optional[int] = None,
                 pid: int = 0) -> Failure:
    rec_node = rec.get("node")
    then_signal = None
    if exitcode < 0 and rec.get("kind") in ("exception", "exit"):
        # It raised (or exited non-zero) first and was signalled while exiting, e.g. stopped by the
        # agent once another rank failed: report the failure it recorded, with its exit status.
        try:
            then_signal = signal.Signals(-exitcode).name
        except ValueError:
            then_signal = f"signal {-exitcode}"
        exitcode = int(rec.get("exit_code") or 1)
    return Failure(
        rank=rank, local_rank=int(local_rank if local_rank is not None else rec.get("local_rank") or 0),
        node=int(rec_node) if rec_node not in (None, "") else node, host=rec.get("host") or host,
        pid=int(rec.get("pid") or pid), exitcode=exitcode, time=float(rec["time"]), summary=rec.get("summary", ""),
        traceback=rec.get("traceback", ""), consequence=bool(rec.get("consequence")), then_signal=then_signal,
    )


def from_agent(failures: Mapping[int, Any], node: Optional[int] = None, host: Optional[str] = None,
               records_dir: Optional[str] = None) -> list[Failure]:
    """Convert the agent's ``{global rank: ProcessFailure}``, completed by the records our children wrote.

    The agent may list only one failed process (forked workers) or list ranks it stopped itself;
    the records tell which rank raised what, and when.
    """
    host = host or socket.gethostname()
    records = read_records(records_dir)
    out = []
    for rank, pf in failures.items():
        data = getattr(pf, "error_file_data", None) or {}
        rec = records.pop(int(rank), None) or (data.get("hasten") if isinstance(data, dict) else None)
        exitcode = int(getattr(pf, "exitcode", 1))
        if rec:
            out.append(_from_record(int(rank), rec, exitcode, node, host, getattr(pf, "local_rank", None),
                                    getattr(pf, "pid", 0)))
            continue
        # No record: killed by a signal, or a program that is not Python (--no_python).
        stopped = exitcode in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
        observed = float(getattr(pf, "timestamp", 0) or 0) + 1.0  # the agent's clock has 1 s steps
        out.append(Failure(
            rank=int(rank), local_rank=int(getattr(pf, "local_rank", 0)), node=node, host=host,
            pid=int(getattr(pf, "pid", 0)), exitcode=exitcode, time=observed, summary="", consequence=stopped,
        ))
    for rank, rec in records.items():  # failed too, but the agent did not list them
        out.append(_from_record(rank, rec, int(rec.get("exit_code") or 1), node, host))
    return out


def finished_ranks(folder: Optional[str]) -> set[int]:
    """Ranks whose script ran to the end (latest restart attempt), from their ``done`` markers."""
    if not folder or not os.path.isdir(folder):
        return set()
    marks: dict[int, int] = {}
    for name in os.listdir(folder):
        if name.startswith("done") and name[4:].isdigit():
            try:
                with open(os.path.join(folder, name)) as f:
                    marks[int(name[4:])] = int(f.read().strip() or 0)
            except (OSError, ValueError):
                continue
    if not marks:
        return set()
    last = max(marks.values())
    return {rank for rank, attempt in marks.items() if attempt == last}


def only_teardown_crashes(failures: list[Failure], finished: set[int]) -> bool:
    """Every failed process had finished its script and then died in native teardown code."""
    return bool(failures) and all(f.exitcode < 0 and not f.traceback and f.rank in finished for f in failures)


def first_failure(failures: list[Failure]) -> Failure:
    """The earliest failure that is not an echo of another one (else simply the earliest)."""
    return min(failures, key=lambda f: (f.consequence, f.time, f.rank))


def exit_status(failure: Failure) -> int:
    """Exit status for the launcher: the process's own, or 128 + signal like a shell."""
    if failure.exitcode > 0:
        return failure.exitcode
    if failure.exitcode < 0:
        return 128 + (-failure.exitcode)
    return 1


def report(failures: list[Failure], quiet: bool = False, positions: Optional[Mapping[int, str]] = None) -> str:
    """The text printed when a job fails: the first failure with its traceback, then the others.

    ``positions``: rank -> where its last heartbeat was (e.g. inside a pipeline stage's schedule
    step), shown after the other ranks' endings."""
    positions = positions or {}
    first = first_failure(failures)
    full = bool(first.traceback) and not quiet
    lines = [f"hasten: rank {first.rank} ({first.where()}) {first.what(with_summary=not full)}" + (":" if full else "")]
    if full:
        lines.append(first.traceback.rstrip("\n"))
    others = sorted((f for f in failures if f is not first), key=lambda f: f.rank)
    if others:
        parts = []
        for f in others:
            why = "stopped by the launcher" if f.signal_name in ("SIGTERM", "SIGINT", "SIGHUP") else (
                f"its collective broke: {_short(f.summary)}" if f.consequence else f.what())
            where = _raised_in(f.traceback) or positions.get(f.rank)
            at = f"; it was in {where}" if where else ""
            parts.append(f"rank {f.rank} ({why}{at})")
        lines.append(f"hasten: after rank {first.rank} failed: " + "; ".join(parts))
    return "\n".join(lines)


def _raised_in(text: str) -> Optional[str]:
    """The position hasten noted on an exception raised inside a pipelined step (``pipeline.tracking``)."""
    for line in reversed(text.splitlines()):
        if line.startswith("hasten: raised in "):
            return line[len("hasten: raised in "):]
    return None


# "[/__w/pytorch/.../pair.cc:553] " before a native library's message: where in C++, not what happened.
_NATIVE_SOURCE = re.compile(r"^(\w+: )?\[[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\] ")


def _short(text: str, limit: int = 90) -> str:
    """One line for a consequence: its first sentence, without the native source location."""
    text = _NATIVE_SOURCE.sub(lambda m: m.group(1) or "", text.strip())
    text = text.split(". ", 1)[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."
