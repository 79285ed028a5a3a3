"""``accelerate tpu-config``'s names, for code that imports them: hasten does not run on TPUs.

The parser takes Accelerate's flags so that existing calls parse; ``tpu_command_launcher`` refuses
with the alternative, since the commands it would send to a TPU pod would run a hasten that cannot
use the TPU (hasten launch refuses ``distributed_type: XLA`` for the same reason).
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ..utils.compat import FeatureNotAvailableError


def tpu_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """A parser with the flags of ``accelerate tpu-config`` (the word replaced; hasten's CLI has no such command)."""
    from .arg_parser import ArgParser

    p = ArgParser(prog="tpu-config", description="Not available in hasten: hasten does not run on TPUs.")
    for flag in ("--config_file", "--tpu_name", "--tpu_zone", "--command_file", "--hasten_version"):
        p.add_argument(flag, default=None)
    p.add_argument("--command", action="append", nargs="+", default=None)
    for flag in ("--use_alpha", "--install_hasten", "--debug"):
        p.add_argument(flag, action="store_true")
    p.set_defaults(func=tpu_command_launcher)
    return p


def tpu_command_launcher(args: argparse.Namespace) -> NoReturn:
    """Refused: hasten does not run on TPUs."""
    raise FeatureNotAvailableError(
        "tpu-config is not available in hasten: hasten does not run on TPUs (distributed_type XLA); use Accelerate "
        "for TPU pods, or hasten launch on GPU or CPU machines")
