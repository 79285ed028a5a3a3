"""Helpers for testing code written for hasten (Accelerate's ``accelerate.test_utils.testing`` names).

Launch helpers build ``hasten launch`` commands; the path helpers point into hasten's package; the
``require_*`` decorators (``requirements.py``) skip what this machine, or hasten, cannot run.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union
from unittest import mock

import torch

from ..state import AcceleratorState, GradientState
# Accelerate's testing module also hands on these names of its utils; test suites import them from here.
from ..utils import (  # noqa: F401
    check_cuda_fp8_capability, compare_versions, gather, is_aim_available, is_bnb_available,
    is_clearml_available, is_comet_ml_available, is_cuda_available, is_datasets_available,
    is_deepspeed_available, is_dvclive_available, is_fp8_available, is_fp16_available, is_habana_gaudi1,
    is_hpu_available, is_import_timer_available, is_matplotlib_available, is_mlflow_available,
    is_mlu_available, is_mps_available, is_musa_available, is_neuron_available, is_npu_available,
    is_pandas_available, is_peft_available, is_pippy_available, is_pytest_available,
    is_schedulefree_available, is_sdaa_available, is_swanlab_available, is_tensorboard_available,
    is_timm_available, is_torch_version, is_torch_xla_available, is_torchao_available,
    is_torchdata_stateful_dataloader_available, is_torchvision_available, is_trackio_available,
    is_transformer_engine_available, is_transformer_engine_mxfp8_available, is_transformers_available,
    is_triton_available, is_wandb_available, is_xpu_available,
)
from ..utils.env_compat import kept_environment
from ..utils.env_compat import str_to_bool
from .backend import device_count, get_backend, memory_allocated_func, torch_device  # noqa: F401 - re-exported
from .requirements import *  # noqa: F401,F403 - Accelerate's testing module holds the decorators too
from .requirements import skip  # noqa: F401

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def get_launch_command(**kwargs: Any) -> list[str]:
    """``["hasten", "launch", ...]`` with one ``--name=value`` flag per keyword (``--name`` for True;
    False and None are left out), to run with ``subprocess`` or ``execute_subprocess_async``."""
    command = ["hasten", "launch"]
    for name, value in kwargs.items():
        if value is True:
            command.append(f"--{name}")
        elif value is not None and value is not False:
            command.append(f"--{name}={value}")
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count, monitor_interval=0.1)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The yes/no environment variable ``key`` as a bool (``default`` when unset)."""
    if key not in os.environ:
        return default
    try:
        return bool(str_to_bool(os.environ[key]))
    except ValueError:
        raise ValueError(f"If set, {key} must be yes or no (it is {os.environ[key]!r}).") from None


_run_slow_tests = parse_flag_from_env("RUN_SLOW", default=False)


def slow(test_case: Any) -> Any:
    """Mark a test as slow: skipped unless the environment sets ``RUN_SLOW=yes``."""
    return unittest.skipUnless(_run_slow_tests, "test is slow")(test_case)


def run_first(test_case: Any) -> Any:
    """Ask pytest-order (when installed) to run this test before the others; otherwise a no-op."""
    try:
        import pytest
    except ImportError:
        return test_case
    return pytest.mark.order(1)(test_case)


class TempDirTestCase(unittest.TestCase):
    """A test case with one temporary folder ``self.tmpdir`` for the whole class, emptied before each
    test (unless ``clear_on_setup`` is False) and removed after the last."""

    clear_on_setup = True
    tmpdir: Path

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmpdir, ignore_errors=True)
        super().tearDownClass()

    def setUp(self) -> None:
        super().setUp()
        if self.clear_on_setup:
            for path in list(self.tmpdir.iterdir()):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()


class AccelerateTestCase(unittest.TestCase):
    """A test case after each of whose tests hasten's process, accelerator and gradient state are
    forgotten, and the ``HASTEN_*``/``ACCELERATE_*`` variables the test set are put back.

    The environment is restored around the whole test (``run``), so it holds for every subclass,
    also one whose ``setUp``/``tearDown`` forget to call ``super()``.
    """

    def run(self, result: Optional[unittest.TestResult] = None) -> Optional[unittest.TestResult]:
        with kept_environment():
            return super().run(result)

    def tearDown(self) -> None:
        super().tearDown()
        AcceleratorState._reset_state(True)
        # The gradient state holds the dataloaders of the test; a later test must not see them.
        GradientState._reset_state()


class MockingTestCase(unittest.TestCase):
    """A test case whose ``setUp`` may start mocks for every test with ``self.add_mocks(...)``; each is
    stopped when its test ends."""

    def add_mocks(self, mocks: Union[Any, list]) -> None:
        """Start ``mocks`` (one patcher or a list) now and stop them when the test ends."""
        self.mocks = list(mocks) if isinstance(mocks, (list, tuple)) else [mocks]
        for patcher in self.mocks:
            patcher.start()
            self.addCleanup(patcher.stop)


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether every process holds the same values in ``tensor`` (gathered over the processes)."""
    from ..utils.operations import gather

    state = AcceleratorState()
    mine = tensor[None].clone().to(state.device)
    every = gather(mine).cpu()  # cpu-on-purpose: compared on the host
    return all(torch.equal(row, mine[0].cpu()) for row in every)  # cpu-on-purpose


class _RunOutput:
    """What ``execute_subprocess_async`` returns: the exit status and the output lines."""

    def __init__(self, returncode: int, stdout: list[str], stderr: list[str]) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def _pump(stream: Any, sink: list[str], echo_to: Optional[Any], label: str) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip()
        sink.append(line)
        if echo_to is not None:
            print(label, line, file=echo_to, flush=True)
    stream.close()


def execute_subprocess_async(cmd: list, env: Optional[dict] = None, stdin: Any = None, timeout: Optional[float] = 180,
                             quiet: bool = False, echo: bool = True) -> _RunOutput:
    """Run ``cmd`` (e.g. ``get_launch_command(...) + [script]``), passing its output through as it
    comes (unless ``quiet``), and return its exit status and output lines.

    Raises RuntimeError with the command's stderr when it fails (a non-zero exit status, a signal
    included) or runs longer than ``timeout`` seconds (then it is stopped, with its children).
    """
    cmd = [str(part) for part in cmd]
    if echo:
        print("\nRunning: ", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out, None if quiet else sys.stdout, "stdout:")),
             threading.Thread(target=_pump, args=(proc.stderr, err, None if quiet else sys.stderr, "stderr:"))]
    for pump in pumps:
        pump.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, 9)  # the launcher's ranks too
        proc.wait()
    for pump in pumps:
        pump.join()
    command = " ".join(cmd)
    if timed_out:
        raise RuntimeError(f"'{command}' ran longer than {timeout} s and was stopped\n\n"
                           "The combined stderr from workers follows:\n" + "\n".join(err))
    if proc.returncode != 0:
        raise RuntimeError(f"'{command}' failed with returncode {proc.returncode}\n\n"
                           "The combined stderr from workers follows:\n" + "\n".join(err))
    return _RunOutput(proc.returncode, out, err)


def pytest_xdist_worker_id() -> int:
    """This pytest-xdist worker's number (``gw3`` -> 3); 0 outside pytest-xdist."""
    return int(re.sub(r"^gw", "", os.environ.get("PYTEST_XDIST_WORKER", "gw0")))


def get_torch_dist_unique_port() -> int:
    """A ``--main_process_port`` for this pytest-xdist worker: 29500 plus its number, so that tests
    running at once do not meet on one port."""
    return 29500 + pytest_xdist_worker_id()


class SubprocessCallException(Exception):
    """``run_command``'s command failed; the message holds its output."""


def run_command(command: list, return_stdout: bool = False, env: Optional[dict] = None) -> Optional[str]:
    """Run ``command``; return its output when ``return_stdout``; raise SubprocessCallException with
    the output when it fails."""
    command = [str(part) for part in command]
    try:
        output = subprocess.check_output(command, stderr=subprocess.STDOUT,
                                         env=os.environ.copy() if env is None else env)
    except subprocess.CalledProcessError as e:
        raise SubprocessCallException(
            f"Command `{' '.join(command)}` failed with the following error:\n\n{e.output.decode()}") from e
    return output.decode("utf-8") if return_stdout else None


def path_in_hasten_package(*components: str) -> Path:
    """A path inside the installed hasten package, e.g.
    ``path_in_hasten_package("test_utils", "scripts", "test_script.py")``."""
    return PACKAGE_DIR.joinpath(*components)


# Accelerate's name, for test suites that keep it: it points into hasten's package as well.
path_in_accelerate_package = path_in_hasten_package


@contextmanager
def assert_exception(exception_class: type, msg: Optional[str] = None) -> Iterator[None]:
    """Assert that the block raises ``exception_class`` (with ``msg`` in its message, when given)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any other class is reported as the wrong one
        assert isinstance(e, exception_class), f"Expected exception of type {exception_class} but got {type(e)}"
        if msg is not None:
            assert msg in str(e), f"Expected message '{msg}' to be in exception but got '{e}'"
        return
    raise AssertionError(f"Expected exception of type {exception_class} but ran without issue.")


def capture_call_output(func: Callable, *args: Any, **kwargs: Any) -> str:
    """Call ``func(*args, **kwargs)`` and return what it printed to stdout."""
    captured = io.StringIO()
    with redirect_stdout(captured):
        func(*args, **kwargs)
    return captured.getvalue()
