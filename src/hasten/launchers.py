"""Start processes from a running interpreter: ``notebook_launcher`` and ``debug_launcher``.

Both fork the current process through torch's elastic agent, so the function (defined in a
notebook, a test, ...) needs no pickling and no re-import; each child gets torchrun's variables
and builds its process group as a script started by ``hasten launch`` would. On CPU,
``num_processes=2`` really gives two ranks.

Forking is refused once CUDA is initialised in the parent (a forked child cannot use it): the check
is ``torch.cuda.is_initialized()`` at launch time; nothing in torch is patched to watch for it.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from .commands import failures as failure_report
from .commands.config_schema import MIXED_PRECISION
from .commands.hardware import cpu_count, cuda_device_count
from .commands.ports import free_port, port_in_use
from .topology import DEFAULT_PORT
from .utils.environment import patch_environment
from .utils.versions import elastic_launch_config

__all__ = ["notebook_launcher", "debug_launcher", "LaunchError"]


class LaunchError(ChildFailedError, RuntimeError):
    """A launched process failed; the message names the rank that failed first and its traceback.

    A ``ChildFailedError`` (what torch's launcher raises, and what scripts catch), with the
    agent's ``name`` and ``failures``, plus the first failing ``rank`` and its ``exitcode``.
    """

    def __init__(self, message: str, rank: int, exitcode: int, name: str = "function",
                 failures: Optional[dict] = None) -> None:
        # Not ChildFailedError.__init__: it would build torch's own message (and needs failures).
        Exception.__init__(self, message)
        self.name, self.failures = name, dict(failures or {})
        self.rank = rank
        self.exitcode = exitcode

    def __reduce__(self) -> Any:
        return type(self), (str(self), self.rank, self.exitcode, self.name, self.failures)


# -- refusing to fork a process that holds CUDA -------------------------------------------------
def cuda_initialised_message() -> str:
    """Why forking is refused, how to find the call that initialised CUDA, and the fix."""
    return ("CUDA is already initialised in this process, and processes forked from it cannot use CUDA. Something "
            "ran before notebook_launcher touched the GPU (e.g. .cuda(), .to('cuda'), torch.cuda.* calls or a library "
            "import); to find it, restart the kernel/interpreter and run the cells again one at a time, checking "
            "torch.cuda.is_initialized() after each. Restart the kernel/interpreter and call notebook_launcher before "
            "anything touches the GPU: build the model and move it to the GPU inside the launched function.")


# -- launching ----------------------------------------------------------------------------------
def _native_threads() -> int:
    """Threads of this process that Python did not start (OpenMP pools, CUDA...); -1 if unknown."""
    try:
        tasks = {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return -1
    python = {t.native_id for t in threading.enumerate()}
    return len(tasks - python)


def _reset_hasten_state() -> None:
    """A forked child inherits the parent's singletons; it must build its own."""
    state = sys.modules.get("hasten.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _forked(function: Callable, threads: int) -> Callable:
    def run(*args: Any) -> Any:
        from .commands._bootstrap import is_peer_failure, write_record

        _reset_hasten_state()
        torch.set_num_threads(threads)
        try:
            result = function(*args)
            saves = sys.modules.get("hasten.checkpointing.commit")
            if saves is not None:  # a background save the function left running fails the function
                saves.wait_all()
            return result
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - report it, then end this process like Python would
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # skip this frame
            text = "".join(traceback.format_exception(type(exc), exc, tb))
            summary = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
            write_record("exception", summary, text, is_peer_failure(exc), 1)
            sys.stderr.write(text)
            sys.stderr.flush()
            raise SystemExit(1) from None

    run.__name__ = getattr(function, "__name__", "function")
    return run


def _port(use_port: Any, master_addr: str, num_nodes: int, node_rank: int) -> int:
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        raise ValueError(f"use_port={use_port!r} is not a port number; pass e.g. use_port='29500' "
                         "(or '0' for a free one)") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"use_port={use_port!r} is out of range; use 1-65535 (or 0 for a free port)")
    if port == 0:
        if num_nodes > 1:
            raise ValueError("use_port=0 (pick a free port) works on one machine only; give every node the same port")
        return free_port(master_addr if master_addr in ("127.0.0.1", "localhost") else "")
    if node_rank == 0 and port_in_use(port):
        raise ValueError(f"port {port} is already in use on this machine; pass another use_port, "
                         "or use_port='0' for a free one")
    return port


def _fork_launch(function: Callable, args: tuple, nprocs: int, env: dict[str, str], master_addr: str, port: int,
                 num_nodes: int = 1, node_rank: int = 0, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                 rdzv_conf: Optional[dict] = None, rdzv_id: str = "none", max_restarts: int = 0,
                 monitor_interval: float = 0.1, log_line_prefix_template: Optional[str] = None) -> None:
    from torch.distributed.launcher.api import elastic_launch

    from .commands.elastic import _quiet_torch_logs

    if torch.cuda.is_initialized():
        raise RuntimeError(cuda_initialised_message())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; start the launcher "
                           "before init_process_group (or anything that creates one)")
    # Children of a process whose OpenMP pool already runs hang in their first parallel op unless
    # they stay single-threaded.
    threads = max(1, cpu_count() // nprocs) if _native_threads() == 0 else 1
    _quiet_torch_logs(debug=False, quiet=False)
    configs = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        configs["rank"] = node_rank
    records = tempfile.mkdtemp(prefix="hasten-failures-")
    child_env = dict(env, HASTEN_FORK_LAUNCHED="1", OMP_NUM_THREADS=str(threads), HASTEN_FAILURE_DIR=records,
                     # torch.cuda.is_available() (the agent calls it) must not initialise CUDA here
                     PYTORCH_NVML_BASED_CUDA_CHECK="1")
    # Cyclic garbage of an earlier launch (an agent, its TCP store) must be freed here: freed in a
    # forked child instead, a store's destructor waits for a server thread the child does not have.
    gc.collect()
    failure: Optional[LaunchError] = None
    try:
        with patch_environment(**child_env):
            config = elastic_launch_config(
                min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=nprocs, run_id=rdzv_id,
                rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint or f"{master_addr}:{port}",
                rdzv_configs=configs, max_restarts=max_restarts, monitor_interval=monitor_interval,
                start_method="fork", log_line_prefix_template=log_line_prefix_template, shutdown_timeout=5,
            )
            elastic_launch(config, _forked(function, threads))(*args)
    except ChildFailedError as err:
        found = failure_report.from_agent(err.failures, node=node_rank, records_dir=records)
        first = failure_report.first_failure(found)
        failure = LaunchError(failure_report.report(found), first.rank, first.exitcode, err.name, err.failures)
        # The agent's frames hold its rendezvous store (a listening server): a caller that keeps the
        # error (a test runner does) must not keep the store, so the frames are cleared and the
        # error is raised outside this block, without the agent's error as its context.
        traceback.clear_frames(err.__traceback__)
    finally:
        shutil.rmtree(records, ignore_errors=True)
    if failure is not None:
        raise failure


def notebook_launcher(function: Callable, args: tuple = (), num_processes: Optional[int] = None,
                      mixed_precision: str = "no", use_port: str = str(DEFAULT_PORT), master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: Optional[dict] = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: Optional[str] = None) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes forked from this interpreter.

    Args:
        function: what each process runs (it creates its ``Accelerator`` itself).
        args: positional arguments for ``function``.
        num_processes: processes on this machine; default: one per visible GPU, else 1.
        mixed_precision: "no", "fp16", "bf16" or "fp8" (read by the ``Accelerator`` of each process).
        use_port: rendezvous port on machine 0; "0" picks a free one (one machine only).
        master_addr, node_rank, num_nodes: where machine 0 is, which machine this is, how many take part.
        rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts, monitor_interval,
        log_line_prefix_template: passed to torch's elastic agent.

    Raises:
        LaunchError: a process failed (the message has the first failing rank's traceback).
        RuntimeError: CUDA was already initialised in this process (the message says how to find the call).
    """
    mixed_precision = str(mixed_precision).lower()
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not one of {', '.join(MIXED_PRECISION)}")
    if num_processes is None:
        num_processes = max(1, cuda_device_count())
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive whole number")
    env = {"HASTEN_MIXED_PRECISION": mixed_precision}
    if num_processes == 1 and num_nodes == 1:
        with patch_environment(**env):
            function(*args)
        return
    port = _port(use_port, master_addr, num_nodes, node_rank) if not rdzv_endpoint else 0
    _fork_launch(function, tuple(args), num_processes, env, master_addr, port, num_nodes, node_rank, rdzv_backend,
                 rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts, monitor_interval, log_line_prefix_template)


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` CPU processes (gloo), to debug distributed code."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive whole number")
    port = _port(0, "127.0.0.1", 1, 0)
    _fork_launch(function, tuple(args), num_processes, {"HASTEN_USE_CPU": "true"}, "127.0.0.1", port)
