"""``hasten config default`` and ``write_basic_config``: a config for this machine, without questions."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Union

from ..config_schema import MIXED_PRECISION, default_config_path, write_config
from ..errors import HastenCLIError
from ..hardware import cuda_device_count
from .paths import config_path_of


def default_config(mixed_precision: str = "no") -> dict[str, Any]:
    """A config for this machine: every GPU in one process each, else one CPU process."""
    gpus = cuda_device_count()
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": mixed_precision,
                           "num_machines": 1, "machine_rank": 0}
    if gpus > 1:
        cfg.update(distributed_type="MULTI_GPU", num_processes=gpus, gpu_ids="all", use_cpu=False)
    elif gpus == 1:
        cfg.update(distributed_type="NO", num_processes=1, gpu_ids="all", use_cpu=False)
    else:
        cfg.update(distributed_type="NO", num_processes=1, use_cpu=True)
    return cfg


default_config_file = default_config_path()  # Accelerate's name for where `config default` writes


def write_basic_config(mixed_precision: str = "no", save_location: str = default_config_file) -> Union[Path, bool]:
    """Write the config that ``hasten config default`` writes, for use from Python (notebooks, tests).

    mixed_precision: "no", "fp16", "bf16" or "fp8". save_location: the file (default: the file
    ``hasten launch`` reads, ``$HASTEN_CONFIG_FILE`` else ``~/.cache/hasten/default_config.yaml``).
    Returns the path written, or ``False`` (with a message) when the file exists already: an
    existing config is never overwritten.
    """
    if save_location == default_config_file:  # left at the default: honour $HASTEN_CONFIG_FILE set since import
        save_location = default_config_path()
    path = Path(os.path.expanduser(os.fspath(save_location)))
    if path.exists():
        print(f"hasten: a configuration already exists at {path}; it was left unchanged. Run `hasten config` to "
              "change it, or pass another save_location.")
        return False
    choice = str(mixed_precision).lower()
    if choice not in MIXED_PRECISION:
        raise ValueError(f"write_basic_config(mixed_precision={mixed_precision!r}): use one of {list(MIXED_PRECISION)}")
    write_config(str(path), default_config(choice))
    return path


def default_command(args: argparse.Namespace) -> int:
    path = config_path_of(args)
    if os.path.exists(path) and not args.overwrite:
        raise HastenCLIError(f"{path} already exists; pass --overwrite to replace it, or --config_file to write elsewhere")
    write_config(path, default_config(args.mixed_precision))
    print(f"hasten: default configuration written to {path}")
    return 0
