"""Helpers shared by the CLI/launch tests: a clean environment and running the real command."""

import json
import os
import socket
import subprocess
import sys
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
