"""The ``hasten`` command: ``config``, ``launch``, ``env``, ``test``, ``estimate-memory``, ``merge-weights``,
``to-fsdp2``.

Everything up to the moment processes start is torch-free, so ``hasten --help`` and
``hasten launch --help`` answer at once. A user error prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from .errors import HastenCLIError, did_you_mean
from .launch_settings import ArgParser

COMMANDS = ("config", "launch", "env", "test", "estimate-memory", "merge-weights", "to-fsdp2")


def build_parser() -> argparse.ArgumentParser:
    from . import config, env, estimate, launch, merge, test, to_fsdp2

    parser = ArgParser(
        prog="hasten",
        description="Run a plain PyTorch training loop on CPU, one GPU, many GPUs or many machines.",
        epilog="Run `hasten <command> --help` for the flags of each command.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"hasten {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", parser_class=ArgParser)
    config.add_parser(subparsers)
    launch.add_parser(subparsers)
    env.add_parser(subparsers)
    test.add_parser(subparsers)
    estimate.add_parser(subparsers)
    merge.add_parser(subparsers)
    to_fsdp2.add_parser(subparsers)
    return parser


def explain_parse_error(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's complaint, rewritten as one line that names the flag and the fix."""
    prog = parser.prog
    cmd = prog.split(" ", 1)[1] + " " if " " in prog else ""
    options = _all_options(parser)
    m = re.match(r"unrecognized arguments: (\S+)", message)
    if m:
        token = m.group(1)
        if token.startswith("-"):
            name = token.split("=")[0]
            canonical = [o for o in options if o.startswith("--") and "-" not in o[2:]]
            hint = did_you_mean(name, canonical, prefix="")
            return f"unknown flag {name}{hint or f'; see {prog} --help'}"
        return f"unexpected argument {token!r}; see {prog} --help"
    m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
    if m:
        flag, problem = m.group(1), m.group(2)
        if flag in ("command", "{" + ",".join(COMMANDS) + "}") or problem.startswith("invalid choice"):
            c = re.search(r"invalid choice: '([^']*)'", problem)
            if c:
                word = c.group(1)
                choices = re.findall(r"'([^']*)'", problem.split("choose from", 1)[-1])
                hint = did_you_mean(word, choices)
                if flag.startswith("-"):  # an option's value, not a (sub)command
                    return f"{flag}: {word!r} is not a choice{hint or '; choose from ' + ', '.join(choices)}"
                return f"unknown command {cmd}{word!r}{hint or '; choose from ' + ', '.join(choices)}"
        if problem.startswith("expected one argument"):
            return f"{flag} needs a value; e.g. {flag} {_example(flag)}"
        if problem.startswith("ignored explicit argument"):
            return f"{flag} takes no value; write {flag} alone"
        if "did you mean" in problem:
            return f"{flag}: {problem}"
        return f"{flag}: {problem}; e.g. {flag} {_example(flag)}"
    if "the following arguments are required" in message:
        if "script" in message:
            return f"{prog} needs a script: {prog} [flags] script.py [script args]"
        return f"{prog}: {message}"
    return f"{prog}: {message}"


def _all_options(parser: argparse.ArgumentParser) -> list[str]:
    """Option strings of a parser and its subcommands (argparse reports a subcommand's unknown
    flags from the top-level parser)."""
    options = []
    for action in parser._actions:
        options.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options.extend(_all_options(sub))
    return options


def _example(flag: str) -> str:
    from .launch_settings import SETTINGS

    name = flag.lstrip("-").replace("-", "_")
    setting = next((s for s in SETTINGS.values() if flag in s.flags or s.name == name), None)
    if setting is None:
        return "VALUE"
    key = setting.key
    if key.kind == "choice":
        return str(key.choices[1] if len(key.choices) > 1 else key.choices[0]).lower()
    return {"int": "2", "port": "29500", "float": "1.0", "bool": "true", "gpu_ids": "0,1"}.get(key.kind, "VALUE")


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
