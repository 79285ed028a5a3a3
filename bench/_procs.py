"""Helpers the issue-25 benchmarks share: start N copies of a script as torchrun would (gloo on
CPU), collect the JSON each rank writes, read peak RSS, and print the command and the load."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(script: str, args: list[str], processes: int, timeout: float = 600,
          extra_path: Optional[str] = None) -> list[dict]:
    """Run ``python script --worker OUT args`` in ``processes`` ranks; every rank writes OUT/rankN.json.
    Returns each rank's dict; raises with the failing rank's log tail. A launch whose port was taken
    between ``free_port`` and the rendezvous (a shared machine) is run once more on a new port."""
    try:
        return _spawn_once(script, args, processes, timeout, extra_path)
    except RuntimeError as e:
        if "address already in use" not in str(e).lower():
            raise
        return _spawn_once(script, args, processes, timeout, extra_path)


def _spawn_once(script: str, args: list[str], processes: int, timeout: float,
                extra_path: Optional[str]) -> list[dict]:
    out = tempfile.mkdtemp(prefix="hasten-bench-")
    port = free_port()
    procs = []
    for rank in range(processes):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                   LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", HASTEN_USE_CPU="1", ACCELERATE_USE_CPU="1")
        if extra_path:
            env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), extra_path])
        log = open(os.path.join(out, f"log{rank}.txt"), "w")
        procs.append((subprocess.Popen([sys.executable, script, "--worker", out, *args], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append((rank, code))
    if failed:
        rank, code = failed[0]
        with open(os.path.join(out, f"log{rank}.txt")) as f:
            raise RuntimeError(f"rank {rank} of {script} exited with {code}:\n{f.read()[-3000:]}")
    results = []
    for rank in range(processes):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def write_result(out: str, value: dict) -> None:
    with open(os.path.join(out, f"rank{int(os.environ.get('RANK', '0'))}.json"), "w") as f:
        json.dump(value, f)


def end_worker() -> None:
    """Leave a worker process once its result is written, skipping interpreter teardown: gloo worker
    threads still releasing tensors while Python finalizes can abort a process that did all its work
    ("terminate called without an active exception"), whichever framework opened the group, and the
    raw PyTorch rows never tear theirs down. Every way ends the same way, so the rows compare."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rss_mb() -> float:
    """This process's resident memory now, MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), MB; reset_peak_rss() starts a new peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def header() -> None:
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")


def emit(payload: dict, path: Optional[str] = None) -> None:
    """The results as one ``JSON:`` line (what the bench smoke tests read), and into ``path`` when given."""
    print("\nJSON: " + json.dumps(payload))
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def footer() -> None:
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
