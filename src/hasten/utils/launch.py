"""Accelerate's ``accelerate.utils.launch`` helpers, answered by hasten's launcher.

Code that builds its own launch (a notebook wrapper, a job scheduler plug-in) calls these with a
namespace from ``hasten.commands.launch.launch_command_parser()``. Each one resolves the settings
exactly as ``hasten launch`` does (flag, else environment, else config file, else default; the same
checks and errors), so what it returns is what ``hasten launch`` would start. Torch-free.

Not available, each with one clear error: starting through ``mpirun`` (hasten reads an MPI layout
when ``hasten launch`` runs inside ``mpirun``), SageMaker jobs and TPU pods.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

# hasten.utils's refused stand-ins (compat.REFUSED gives the reason and the alternative), here under the
# module name Accelerate has them in.
from .refused import PrepareForLaunch, prepare_sagemager_args_inputs, prepare_tpu  # noqa: F401

__all__ = ["PrepareForLaunch", "prepare_deepspeed_cmd_env", "prepare_multi_gpu_env", "prepare_sagemager_args_inputs",
           "prepare_simple_launcher_cmd_env", "prepare_tpu"]


def _plan(args: argparse.Namespace, need_script: bool) -> Any:
    from ..commands.launch import build_plan

    return build_plan(args, need_script=need_script)


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command of one process (``[python, script, *script_args]``) and the environment it runs with
    (this process's environment plus the settings ``hasten launch`` passes to its processes)."""
    plan = _plan(args, need_script=True)
    env = dict(os.environ)
    env.update(plan.child_env)
    return [plan.entrypoint, *plan.args], env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the processes of a multi-process launch, as Accelerate's.

    Also sets torchrun's names on ``args`` (``nproc_per_node``, ``nnodes``, ``node_rank``,
    ``master_addr``, ``master_port``, as strings); a port of 0 becomes a free port picked now.
    """
    plan = _plan(args, need_script=False)
    args.nproc_per_node = str(plan.nproc_per_node)
    args.nnodes = str(plan.num_machines)
    args.node_rank = str(plan.machine_rank)
    args.master_addr = plan.main_ip
    args.master_port = str(plan.main_port)
    env = dict(os.environ)
    env.update(plan.child_env)
    return env


def prepare_deepspeed_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one process of a DeepSpeed launch (hasten starts DeepSpeed jobs with
    its own launcher, not ``deepspeed``'s, so the command is the plain per-process one)."""
    return prepare_simple_launcher_cmd_env(args)


def _typed(text: str) -> Any:
    """A script argument's value as a SageMaker hyperparameter: bool, int, float or the text itself."""
    if text in ("True", "False"):
        return text == "True"
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number


def _convert_nargs_to_dict(nargs: list[str]) -> dict[str, Any]:
    """``["--lr", "5e-5", "--do_train", "False"]`` -> ``{"lr": 5e-05, "do_train": False}``: a script's
    arguments as SageMaker hyperparameters. Every flag needs a value (SageMaker passes ``--key value``
    pairs): a bare switch raises ``ValueError``."""
    out: dict[str, Any] = {}
    index = 0
    while index < len(nargs):
        flag = nargs[index]
        if not flag.startswith("-"):
            raise ValueError(f"script argument {flag!r} follows no --flag; give arguments as --name value pairs")
        if index + 1 >= len(nargs) or nargs[index + 1].startswith("-") and not _is_number(nargs[index + 1]):
            raise ValueError(f"script argument {flag} has no value: SageMaker hyperparameters need one "
                             f"(write e.g. {flag} True instead of a store_true switch)")
        out[flag.lstrip("-").replace("-", "_")] = _typed(nargs[index + 1])
        index += 2
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
