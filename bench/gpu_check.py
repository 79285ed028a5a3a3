"""The GPU-only behaviours of hasten, checked in one command that fits a short GPU loan (issue 24, item 14).

    python bench/gpu_check.py                 # on a machine with one GPU: <= 8 minutes, one line per check
    python bench/gpu_check.py --list          # the checks, in the order they run
    python bench/gpu_check.py --only fp8,flight_recorder --deadline 300
    python bench/gpu_check.py --cpu-dry-run   # every check's code path on CPU (small sizes, no timing claims)

Each check runs in a process of its own with its own time budget (a hang or a crash costs that check
only), cheapest and most likely to break first, under a global deadline; its line is printed as soon as
it ends: ``PASS``, ``FAIL`` (the behaviour is wrong), ``ERROR`` (the check itself crashed or hung) or
``SKIP`` (what the machine lacks: CUDA, torchao, an fp8 GPU, time). The exit status is 1 when a check
FAILed or ERRORed, else 0 (also when everything was skipped, as on a machine without a GPU).
Run from the repository root with ``PYTHONPATH=src`` (or hasten installed); the checks are in
``bench/gpu_check_cases.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gpu_check_cases as cases  # noqa: E402 - found beside this file

RESULT = "GPU_CHECK_RESULT "  # the line a check's process ends with: this prefix, then JSON
DEFAULT_DEADLINE_S = 480.0
MIN_SLOT_S = 15.0  # a check is not started with less time than this left before the deadline


def machine_facts() -> dict:
    """What the checks' requirements are judged against; never raises."""
    facts: dict = {"torch": None, "cuda": False, "gpus": 0, "capability": None, "gpu": None,
                   "torchao": False, "transformers": False, "pytest": False}
    import importlib.util

    for name in ("torchao", "transformers", "pytest"):
        facts[name] = importlib.util.find_spec(name) is not None
    try:
        import torch
    except ImportError as e:
        facts["torch_error"] = str(e)
        return facts
    facts["torch"] = torch.__version__
    try:
        facts["cuda"] = bool(torch.cuda.is_available())
        if facts["cuda"]:
            facts["gpus"] = torch.cuda.device_count()
            facts["capability"] = list(torch.cuda.get_device_capability(0))
            facts["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # a broken driver says so here, not as a crash of every check
        facts["cuda_error"] = f"{type(e).__name__}: {e}"
    return facts


def run_here(name: str, dry_run: bool, facts: dict) -> dict:
    """Run one check in this process: a result dict (status, detail, seconds)."""
    check = cases.CHECKS[name]
    start = time.perf_counter()
    try:
        detail = check.function(cases.Context(dry_run=dry_run, facts=facts))
        status = "PASS"
    except cases.Skip as e:
        status, detail = "SKIP", str(e)
    except AssertionError as e:
        status, detail = "FAIL", str(e) or "assertion failed"
    except Exception as e:  # the check's own code broke: reported, the next check still runs
        import traceback

        status = "ERROR"
        detail = f"{type(e).__name__}: {e} | " + " / ".join(traceback.format_exc().strip().splitlines()[-6:-1])
    finally:
        cases.reset_hasten()
    return {"status": status, "detail": str(detail), "seconds": time.perf_counter() - start}


def run_in_subprocess(name: str, dry_run: bool, budget: float) -> dict:
    """Run one check in a child process of its own session, killed (with its children) after ``budget``.

    The child writes to a file, not a pipe: a compile worker it leaves behind would hold a pipe open
    and make the wait outlast the child. Its whole process group is killed once it ends, for the same reason.
    """
    command = [sys.executable, os.path.abspath(__file__), "--run", name] + (["--cpu-dry-run"] if dry_run else [])
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", GPU_CHECK_BUDGET_S=str(budget)))
        try:
            proc.wait(timeout=budget)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.seek(0)
        output = log.read()
    seconds = time.perf_counter() - start
    if timed_out:
        return {"status": "ERROR", "seconds": seconds,
                "detail": f"no result within its {budget:.0f} s budget (a hang?); last output: {_tail(output)}"}
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return {"status": "ERROR", "seconds": seconds,
            "detail": f"the check's process ended with exit status {proc.returncode} and no result; "
                      f"last output: {_tail(output)}"}


def _tail(output: Optional[str], lines: int = 4) -> str:
    return " / ".join((output or "").strip().splitlines()[-lines:]) or "(none)"


def _print_line(name: str, result: dict) -> None:
    print(f"{result['status']:<5} {name} ({result.get('seconds', 0.0):.1f} s): {result['detail']}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the checks in the order they run, and exit")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, help="seconds for everything")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run every check's code path on CPU with small sizes (GPU-only claims are not judged)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the checks one after another in this process (try-blocks) instead of one "
                             "process each: faster start, but a hang stops everything")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: the child process of one check
    args = parser.parse_args(argv)

    if args.list:
        for check in cases.CHECKS.values():
            print(f"{check.name:<24} {check.budget_s:>4.0f} s  {check.summary}")
        return 0
    names = [n.strip() for n in (args.run or args.only).split(",") if n.strip()] or list(cases.CHECKS)
    unknown = [n for n in names if n not in cases.CHECKS]
    if unknown:  # before torch is imported: a typo costs no seconds
        print(f"gpu_check: --only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(cases.CHECKS)}",
              file=sys.stderr)
        return 2
    facts = machine_facts()
    if args.run:
        result = run_here(args.run, args.cpu_dry_run, facts)
        print(RESULT + json.dumps(result), flush=True)
        return 0
    where = (f"{facts['gpu']} (compute capability {'.'.join(map(str, facts['capability']))}, {facts['gpus']} GPU(s))"
             if facts["cuda"] else "no CUDA device")
    print(f"gpu_check: torch {facts['torch']}, {where}, torchao {'yes' if facts['torchao'] else 'no'}"
          f"{', CPU dry run' if args.cpu_dry_run else ''}; deadline {args.deadline:.0f} s", flush=True)
    start = time.perf_counter()
    counts = {"PASS": 0, "FAIL": 0, "ERROR": 0, "SKIP": 0}
    for name in names:
        check = cases.CHECKS[name]
        left = args.deadline - (time.perf_counter() - start)
        reason = check.missing(facts, args.cpu_dry_run)
        if reason is None and left < MIN_SLOT_S:
            reason = f"the global deadline ({args.deadline:.0f} s) leaves {max(left, 0):.0f} s"
        if reason is not None:
            result = {"status": "SKIP", "detail": reason, "seconds": 0.0}
        elif args.in_process:
            result = run_here(name, args.cpu_dry_run, facts)
        else:
            result = run_in_subprocess(name, args.cpu_dry_run, min(check.budget_s, left))
        counts[result["status"]] += 1
        _print_line(name, result)
    print(f"gpu_check: {counts['PASS']} passed, {counts['FAIL'] + counts['ERROR']} failed, {counts['SKIP']} skipped "
          f"in {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if counts["FAIL"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
