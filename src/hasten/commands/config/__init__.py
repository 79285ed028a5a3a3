"""``hasten config`` (questionnaire), ``config default``, ``config update``, ``config explain``.

A package, as Accelerate's ``accelerate.commands.config`` is, so that code importing its submodules
(``config_args`` for the config dataclasses, ``default`` for ``write_basic_config``, ``update``) runs
with the word replaced. Torch-free: ``hasten --help`` imports this.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from ..config_schema import TOP, BadValue, coerce, default_config_path, read_config
from .default import default_command, default_config, default_config_file, write_basic_config
from .questionnaire import ask_config, questionnaire_command
from .update import apply_change, update_command

__all__ = ["add_parser", "apply_change", "ask_config", "default_config", "default_config_file", "load_effective",
           "write_basic_config"]


def add_parser(subparsers: Any) -> None:
    from ..launch_settings import add_launch_arguments

    p = subparsers.add_parser(
        "config", help="Answer a few questions and write the launch config file.",
        description="Ask how you train (machines, processes, precision, compile, FSDP/DeepSpeed) and write the "
                    "answers as YAML to --config_file (default: $HASTEN_CONFIG_FILE, else "
                    "~/.cache/hasten/default_config.yaml).",
    )
    p.add_argument("--config_file", "--config-file", default=None, metavar="PATH", help="Where to write the file.")
    p.set_defaults(func=questionnaire_command)
    sub = p.add_subparsers(dest="config_command", metavar="{default,update,explain}")
    d = sub.add_parser("default", help="Write a config for this machine without asking questions.")
    d.add_argument("--config_file", "--config-file", default=None, metavar="PATH", help="Where to write the file.")
    d.add_argument("--mixed_precision", "--mixed-precision", default="no", type=_precision, metavar="{no,fp16,bf16,fp8}")
    d.add_argument("--overwrite", action="store_true", help="Replace an existing file.")
    d.set_defaults(func=default_command)
    u = sub.add_parser("update", help="Rewrite a config (e.g. an old Accelerate one) in the current format, "
                                      "optionally changing keys: update num_processes=4 fsdp_config.fsdp_version=2.")
    u.add_argument("--config_file", "--config-file", default=None, metavar="PATH", help="The file to update.")
    u.add_argument("changes", nargs="*", metavar="key=value", help="Keys to change (sections as section.key).")
    u.set_defaults(func=update_command)
    e = sub.add_parser("explain", help="Print each effective launch setting and where it comes from.",
                       usage="hasten config explain [launch flags] [script.py [script args]]")
    add_launch_arguments(e, script=False)
    e.add_argument("training_script", nargs="?", default=None, metavar="script")
    e.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="...")
    e.set_defaults(func=explain_command)


def _precision(text: str) -> str:
    try:
        return coerce(TOP["mixed_precision"], text)
    except BadValue as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def explain_command(args: argparse.Namespace) -> int:
    from ..launch import build_plan, explain

    print(explain(build_plan(args, need_script=False)))
    return 0


def load_effective(path: Optional[str] = None) -> tuple[Optional[str], dict[str, Any]]:
    """The config ``hasten launch`` would read by default (path, content), for ``hasten env``."""
    path = path or default_config_path()
    if not os.path.isfile(path):
        return None, {}
    return path, read_config(path)
