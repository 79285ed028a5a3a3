"""Start a planned job with torch's elastic agent and turn its outcome into an exit status.

The only module of the CLI that imports torch, and only when processes are really started.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Optional

from . import failures as failure_report
from . import hangs, run_summary
from .ports import free_port
from ..utils.versions import elastic_launch_config

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

# The wrapper each python child runs in, so that a failure can be traced to the rank that failed first.
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py")
# Launches on a port the launcher picked itself, when other programs keep taking it first.
PORT_TRIES = 3
# Seconds between SIGTERM and SIGKILL when the agent stops the other processes after a failure.
SHUTDOWN_GRACE_S = 5


def worker_command(plan: "Plan") -> tuple[str, list[str]]:
    """The command each process runs: python scripts and modules go through the bootstrap."""
    if plan.entrypoint == sys.executable:
        return sys.executable, ["-u", BOOTSTRAP, *plan.args]
    return plan.entrypoint, list(plan.args)


def _quiet_torch_logs(debug: bool, quiet: bool) -> None:
    """The agent's own failure messages repeat what our report says better; keep them out."""
    level = logging.INFO if debug else (logging.ERROR if quiet else logging.WARNING)
    logging.getLogger("torch.distributed.elastic").setLevel(level)
    if not debug:
        for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                     "torch.distributed.elastic.multiprocessing.errors", "torch.distributed.launcher.api"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def run_elastic(plan: "Plan") -> int:
    debug = bool(plan.res["debug"])
    os.environ["HASTEN_LAUNCHER_PID"] = str(os.getpid())
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    import torch.distributed.launcher.api  # noqa: F401 - imported now so that its loggers' levels stay ours

    _quiet_torch_logs(debug, plan.quiet)  # after the imports: torch sets its loggers' levels on import

    tee, log_dir = plan.res["tee"], plan.res["log_dir"]
    logs = DefaultLogsSpecs(log_dir=log_dir, tee=Std.from_str(tee) if tee else Std.NONE)
    grace: Optional[int] = None if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ else SHUTDOWN_GRACE_S
    rdzv_configs = dict(plan.rdzv_configs)
    if plan.port_picked and plan.rdzv_backend == "c10d":
        # Host the store or fail: on a port another program took meanwhile, torch would otherwise connect to
        # that program's store as a client and share it.
        rdzv_configs.setdefault("is_host", "1")

    def config_for(port: int):
        return elastic_launch_config(
            min_nodes=plan.num_machines, max_nodes=plan.num_machines, nproc_per_node=plan.nproc_per_node,
            run_id=plan.run_id, rdzv_backend=plan.rdzv_backend, rdzv_endpoint=f"{plan.main_ip}:{port}",
            rdzv_configs=dict(rdzv_configs), max_restarts=plan.res["max_restarts"],
            monitor_interval=plan.res["monitor_interval"], logs_specs=logs, start_method="spawn",
            shutdown_timeout=grace, role="hasten",
            log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:"),
        )

    entrypoint, args = worker_command(plan)
    node = plan.machine_rank if plan.rdzv_backend == "static" else None
    records = tempfile.mkdtemp(prefix="hasten-failures-")
    os.environ["HASTEN_FAILURE_DIR"] = records
    watchdog = _start_watchdog(plan)
    figures_file, _ = run_summary.summary_path(records, os.environ)  # the launch's one temporary folder
    os.environ[run_summary.SUMMARY_ENV] = figures_file  # a ThroughputMonitor in the script writes there
    started = time.monotonic()
    try:
        port = plan.main_port
        for attempt in range(PORT_TRIES):
            try:
                status = _run_agent(plan, config_for(port), entrypoint, args, node, records, logs, watchdog,
                                    retry_port=plan.port_picked and attempt + 1 < PORT_TRIES)
                break
            except _PortTaken:  # no process was started yet: the rendezvous store could not bind
                taken, port = port, free_port(plan.main_ip)
                if bool(plan.res["debug"]):
                    print(f"hasten: port {taken} was taken before the rendezvous bound it; trying {port}",
                          file=sys.stderr)
        if status == 0 and watchdog.report is None and not plan.quiet:
            figures = run_summary.read_summary(figures_file)
            processes = (figures or {}).get("processes") or plan.nproc_per_node * plan.num_machines
            print(run_summary.summary_line(processes, time.monotonic() - started, figures), file=sys.stderr,
                  flush=True)
    finally:
        watchdog.close()
        shutil.rmtree(records, ignore_errors=True)
    if watchdog.report is not None:
        print(watchdog.report, file=sys.stderr, flush=True)  # its folder is kept: the stacks are in it
        return hangs.HANG_EXIT_STATUS
    shutil.rmtree(watchdog.folder, ignore_errors=True)
    return status


def _start_watchdog(plan: "Plan") -> hangs.Watchdog:
    """The processes' heartbeat folder, torch's flight recorder settings, and the watchdog thread."""
    folder = tempfile.mkdtemp(prefix="hasten-hang-")
    os.environ.update(hangs.child_env(folder, plan.device))
    value = plan.res.values["hang_timeout"]
    source = f"{value.source}" if value.source != "default" else "default; --hang_timeout or HASTEN_HANG_TIMEOUT"
    # The processes bound their wait for each other at a collective save by it (checkpointing/solo.py).
    os.environ["HASTEN_HANG_TIMEOUT"] = str(float(value.value))
    launcher = os.getpid()
    return hangs.Watchdog(folder, float(value.value), source, plan.nproc_per_node,
                          stop=lambda: os.kill(launcher, signal.SIGTERM)).start()  # the agent then stops the processes


class _PortTaken(Exception):
    """The rendezvous port the launcher picked was bound by another program before the store could bind it."""


def _address_in_use(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE or "address already in use" in str(exc).lower():
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _run_agent(plan: "Plan", config, entrypoint: str, args: list, node: Optional[int], records: str, logs,
               watchdog: hangs.Watchdog, retry_port: bool = False) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import launch_agent

    debug = bool(plan.res["debug"])
    try:
        launch_agent(config, entrypoint, args)
    except ChildFailedError as err:
        if watchdog.report is not None:
            return hangs.HANG_EXIT_STATUS
        found = failure_report.from_agent(err.failures, node=node, host=socket.gethostname(), records_dir=records)
        if failure_report.only_teardown_crashes(found, failure_report.finished_ranks(records)):
            names = ", ".join(f"rank {f.rank} ({f.signal_name})" for f in found)
            print(f"hasten: warning: {names} crashed while exiting, after the script had finished; "
                  "the job's work is complete (a native teardown crash in torch, not in your script)", file=sys.stderr)
            return 0
        if not found:
            print(f"hasten: error: a process failed: {err}", file=sys.stderr)
            return 1
        beats = hangs.read_beats(watchdog.folder)  # where the other ranks were (a pipeline stage's action)
        positions = {rank: b["pipeline"] for rank, b in beats.items() if b.get("pipeline")}
        print(failure_report.report(found, quiet=plan.quiet, positions=positions), file=sys.stderr)
        if plan.res["log_dir"]:
            print(f"hasten: every failed rank's traceback: {logs.root_log_dir}/attempt_*/<local rank>/traceback.log",
                  file=sys.stderr)
        return failure_report.exit_status(failure_report.first_failure(found))
    except SignalException as exc:
        if watchdog.report is not None:
            return hangs.HANG_EXIT_STATUS
        sig = getattr(exc, "sigval", signal.SIGTERM)
        if sig == signal.SIGINT:
            print(_interrupted(plan), file=sys.stderr)
        else:
            print(f"hasten: stopped by {signal.Signals(sig).name}; the processes were stopped too", file=sys.stderr)
        return 128 + int(sig)
    except KeyboardInterrupt:
        print(_interrupted(plan), file=sys.stderr)
        return 130
    except Exception as exc:  # rendezvous and store errors: one line, no traceback unless --debug
        if retry_port and _address_in_use(exc):
            raise _PortTaken() from exc
        if debug:
            raise
        if _address_in_use(exc):
            print(f"hasten: error: port {config.rdzv_endpoint.rpartition(':')[2]} was taken by another program before "
                  "the rendezvous could bind it; pass --main_process_port 0 to pick a free port, or another number",
                  file=sys.stderr)
            return 1
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"hasten: error: the launch failed ({type(exc).__name__}: {text}); rerun with --debug for details",
              file=sys.stderr)
        return 1
    if (plan.res["log_dir"] or plan.res["tee"]) and not plan.quiet:
        print(f"hasten: logs in {logs.root_log_dir}", file=sys.stderr)
    return 0


def _interrupted(plan: "Plan") -> str:
    """The one line for Ctrl-C: the processes print nothing of their own (``_bootstrap.py``)."""
    count = plan.nproc_per_node
    return f"hasten: interrupted (Ctrl-C); stopped {count} process{'es' if count != 1 else ''}"
