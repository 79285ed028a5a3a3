"""The argparse of every ``hasten`` command: one-line errors and a compact help layout.

``ArgParser.error`` rewrites argparse's complaint with ``explain_parse_error`` into one line that names
the flag and the fix, raised as ``HastenCLIError`` so ``main()`` prints it and exits 2. Torch-free.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from .errors import HastenCLIError, did_you_mean
from .launch_settings import SETTINGS

COMMANDS = ("config", "launch", "env", "test", "estimate-memory", "merge-weights", "to-fsdp2")


class ArgParser(argparse.ArgumentParser):
    """argparse that raises ``HastenCLIError`` (one line, exit 2) instead of printing usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise HastenCLIError(explain_parse_error(self, message))


class HelpFormatter(argparse.HelpFormatter):
    """Shows ``--num_processes N`` once, not each spelling (``--num-processes`` works too)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=min(110, max(80, _terminal_width())))

    def _format_action_invocation(self, action: argparse.Action) -> str:
        strings = [o for o in action.option_strings if not (o.startswith("--") and "-" in o[2:])]
        if not action.option_strings or not strings:
            return super()._format_action_invocation(action)
        if action.nargs == 0:
            return ", ".join(strings)
        return ", ".join(strings) + " " + self._format_args(action, action.dest.upper())


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 100


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
    name = flag.lstrip("-").replace("-", "_")
    setting = next((s for s in SETTINGS.values() if flag in s.flags or s.name == name), None)
    if setting is None:
        return "VALUE"
    key = setting.key
    if key.kind == "choice":
        return str(key.choices[1] if len(key.choices) > 1 else key.choices[0]).lower()
    return {"int": "2", "port": "29500", "float": "1.0", "bool": "true", "gpu_ids": "0,1"}.get(key.kind, "VALUE")
