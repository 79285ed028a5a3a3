"""Where a ``hasten config`` sub-command reads or writes: ``--config_file``, else the default file."""

from __future__ import annotations

import argparse
import os

from ..config_schema import default_config_path


def config_path_of(args: argparse.Namespace) -> str:
    """``--config_file`` (``~`` expanded), else ``$HASTEN_CONFIG_FILE``, else the default file."""
    return os.path.expanduser(args.config_file) if getattr(args, "config_file", None) else default_config_path()
