"""Helpers shared by the CLI/launch tests: a clean environment and running the real command."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Variables that would leak the developer's setup (or a scheduler) into the tests.
LEAKY_PREFIXES = ("HASTEN_", "ACCELERATE_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "FSDP_", "TORCHELASTIC_",
                  "PARALLELISM_CONFIG_")
LEAKY_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MPI_LOCALNRANKS")


def clean_env(config_file, **extra):
    """os.environ without launcher/scheduler variables, with the config file pointed at ``config_file``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY_PREFIXES) and k not in LEAKY_NAMES}
    env["HASTEN_CONFIG_FILE"] = str(config_file)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def ranks(folder, n, prefix="rank"):
    """What each of ``n`` ranks reported in ``folder/<prefix><rank>.json`` (asserting each wrote one)."""
    out = []
    for rank in range(n):
        path = os.path.join(folder, f"{prefix}{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote nothing; files: {os.listdir(folder)}"
        with open(path) as f:
            out.append(json.load(f))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hasten(args, env, cwd=None, timeout=120):
    """Run `python -m hasten.commands.cli ARGS` (the real command, exec and all); returns (rc, out, err, secs)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.cli", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def script(name):
    return os.path.join(HERE, name)


class BackgroundLaunch:
    """``hasten launch --cpu --num_processes 2 FLAGS SCRIPT MODE OUT`` started now, in ``root`` (its ``tmp`` and
    ``out`` folders); ``finish(timeout)`` waits for it and gives (exit status, stderr). ``ended`` is when it exited."""

    def __init__(self, root, script_name, mode, flags=(), **extra_env):
        self.tmp, self.out = root / "tmp", root / "out"
        self.tmp.mkdir()
        self.out.mkdir()
        env = clean_env(root / "absent.yaml", TMPDIR=self.tmp, **extra_env)
        self.proc = subprocess.Popen([sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes",
                                      "2", *flags, script(script_name), mode, str(self.out)],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err, self.ended = "", None
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self):
        _, self.err = self.proc.communicate()
        self.ended = time.monotonic()

    def finish(self, timeout):
        import pytest

        self.thread.join(timeout)
        if self.thread.is_alive():
            self.proc.kill()
            self.thread.join(30)
            pytest.fail(f"the launch did not end within {timeout} s: {self.err[-3000:]}")
        return self.proc.returncode, self.err
