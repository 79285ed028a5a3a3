"""``hasten test``: run the built-in sanity script on the configured processes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

SANITY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sanity.py")


def test_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``hasten test`` (a sub-command of ``subparsers``, or alone, as Accelerate's):
    ``test_command(test_command_parser().parse_args([]))`` runs the checks from Python."""
    from .arg_parser import ArgParser
    from .launch_settings import add_launch_arguments

    settings = dict(
        description="Launch hasten's sanity script with the same settings as `hasten launch` (config file, "
                    "environment, flags) and report whether every check passed.",
    )
    if subparsers is not None:
        p = subparsers.add_parser(
            "test", help="Check the setup: collectives, data sharding and one training step on the configured processes.",
            **settings)
    else:
        p = ArgParser(prog="hasten test", **settings)
    add_launch_arguments(p, script=False)
    p.set_defaults(func=test_command)
    return p


def add_parser(subparsers: Any) -> None:
    test_command_parser(subparsers)


def test_command(args: argparse.Namespace) -> int:
    from .launch import build_plan, explain, run_plan

    args.training_script, args.training_script_args = SANITY, []
    plan = build_plan(args)
    if getattr(args, "dry_run", False):
        print(explain(plan))
        return 0
    if not plan.quiet:
        print(f"hasten test: running the sanity checks on {plan.num_processes} process(es) "
              f"({plan.distributed_type}, {plan.device})", flush=True)
    code = run_plan(plan, exec_ok=False)
    if code == 0:
        print(f"hasten test: success: every check passed on {plan.num_processes} process(es) "
              f"({plan.distributed_type}).", flush=True)
    else:
        print(f"hasten test: FAILED (exit status {code}); see the messages above.", file=sys.stderr, flush=True)
    return code
