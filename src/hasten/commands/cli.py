"""The ``hasten`` command: ``config``, ``launch``, ``env``, ``test``, ``estimate-memory``, ``merge-weights``,
``to-fsdp2``.

Everything up to the moment processes start is torch-free, so ``hasten --help`` and
``hasten launch --help`` answer at once. A user error prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .arg_parser import COMMANDS, ArgParser
from .errors import HastenCLIError


def build_parser() -> argparse.ArgumentParser:
    from . import config, env, estimate, launch, merge, test, to_fsdp2

    parser = ArgParser(
        prog="hasten",
        description="Run a plain PyTorch training loop on CPU, one GPU, many GPUs or many machines.",
        epilog="Run `hasten <command> --help` for the flags of each command.",
    )
    from .. import __accelerate_version__, __hasten_version__, __version__

    parser.add_argument("--version", action="version", version=(
        f"hasten {__hasten_version__} (Accelerate API {__accelerate_version__}; package version {__version__})"))
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", parser_class=ArgParser)
    config.add_parser(subparsers)
    launch.add_parser(subparsers)
    env.add_parser(subparsers)
    test.add_parser(subparsers)
    estimate.add_parser(subparsers)
    merge.add_parser(subparsers)
    to_fsdp2.add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hasten`` console script; returns the exit status."""
    exec_ok = argv is None  # the real command may replace itself with the script; tests may not
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 0 if not argv else 2
        args._exec_ok = exec_ok
        code = int(args.func(args) or 0)
    except HastenCLIError as exc:
        text = str(exc).strip()
        print(f"hasten: error: {text.splitlines()[0] if text else 'bad input'}", file=sys.stderr)
        return HastenCLIError.exit_code
    except BrokenPipeError:  # e.g. `hasten launch --dry_run ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if exec_ok and "torch" in sys.modules:
        # The job is over; tearing down an interpreter that loaded torch only costs time.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
