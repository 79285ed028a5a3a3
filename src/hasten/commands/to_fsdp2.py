"""``hasten to-fsdp2``: rewrite an FSDP1 launch config for FSDP2, as ``accelerate to-fsdp2`` does.

The FSDP section keeps every key FSDP2 understands; ``fsdp_sharding_strategy`` becomes
``fsdp_reshard_after_forward`` (whether parameters are freed after the forward pass); keys that
FSDP2 has no use for are dropped with a note on stderr; keys this command does not know are kept;
``fsdp_version`` becomes 2. Everything outside ``fsdp_config`` is copied unchanged.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .errors import FileInTheWayError, HastenCLIError, MissingFileError

# What each FSDP1 sharding strategy means for FSDP2's reshard_after_forward.
_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False,
            "NO_SHARD": False}
# FSDP1 also took the strategies as 1-based numbers (torch's ShardingStrategy order).
_BY_NUMBER = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
_DROPPED = {
    "fsdp_backward_prefetch": "FSDP2 always prefetches the next all-gather in backward",
    "fsdp_sync_module_states": "FSDP2 loads weights through fsdp_cpu_ram_efficient_loading instead",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
    "fsdp_forward_prefetch": "FSDP2 has no forward prefetch setting yet",
}


def to_fsdp2_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``hasten to-fsdp2`` (a sub-command of ``subparsers``, or alone, as Accelerate's)."""
    from .arg_parser import ArgParser

    settings = dict(
        description="Read an FSDP1 launch config (hasten's or Accelerate's), rename and convert its fsdp_config "
                    "keys for FSDP2 and write the result to --output_file (or over the input with --overwrite).",
    )
    if subparsers is not None:
        p = subparsers.add_parser("to-fsdp2", help="Convert a launch config from FSDP1 to FSDP2.", **settings)
    else:
        p = ArgParser(prog="hasten to-fsdp2", **settings)
    p.add_argument("--config_file", "--config-file", required=True, metavar="PATH", help="The config to convert.")
    p.add_argument("--output_file", "--output-file", default=None, metavar="PATH",
                   help="Where to write the converted config; without it, --overwrite replaces --config_file.")
    p.add_argument("--overwrite", action="store_true",
                   help="Replace an existing output file (or the input file when --output_file is not given).")
    p.set_defaults(func=to_fsdp2_command)
    return p


def add_parser(subparsers: Any) -> None:
    to_fsdp2_command_parser(subparsers)


# Accelerate logs its notes on this logger (word replaced); code that watches the log (assertLogs, caplog)
# sees hasten's there too. The NullHandler keeps Python's last-resort handler from printing them a second time
# next to the stderr line when logging is not configured.
_LOGGER = logging.getLogger("hasten.commands.to_fsdp2")
_LOGGER.addHandler(logging.NullHandler())


def _note(text: str, level: int = logging.WARNING) -> None:
    print(f"hasten to-fsdp2: {text}", file=sys.stderr)
    _LOGGER.log(level, text)


def _reshard(key: str, value: Any) -> bool:
    """The reshard_after_forward value of an FSDP1 sharding strategy (name or number)."""
    if isinstance(value, bool):
        return value  # already an FSDP2 value
    name = _BY_NUMBER.get(value) if isinstance(value, int) else str(value).upper()
    if name not in _RESHARD:
        raise HastenCLIError(f"fsdp_config.{key}: {value!r} is not an FSDP sharding strategy; use one of "
                             f"{', '.join(_RESHARD)} (or 1-5)")
    if name.startswith("HYBRID"):
        _note(f"fsdp_config.{key}={name}: FSDP2 config files have no hybrid sharding; set "
              "parallelism_config.parallelism_config_dp_replicate_size for replicas across machines")
    return _RESHARD[name]


def convert_config_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``fsdp_config`` section rewritten for FSDP2 (notes go to stderr)."""
    section = config.get("fsdp_config")
    if not section:
        _note("No FSDP config found in the config file, skipping conversion: it is written unchanged", logging.INFO)
        return config
    if not isinstance(section, dict):
        raise HastenCLIError(f"fsdp_config must be a mapping of fsdp_* keys, not {type(section).__name__}; "
                             "fix the config file")
    if section.get("fsdp_version", 1) == 2:
        _note("Config already specifies FSDP2, skipping conversion... (fsdp_version: 2): it is written unchanged "
              "(set fsdp_version: 1 to convert FSDP1 key names)")
        return config
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key in _DROPPED:
            _note(f"fsdp_config.{key} is dropped: {_DROPPED[key]}")
        elif key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
            out["fsdp_reshard_after_forward"] = _reshard(key, value)
        else:
            out[key] = value
    out["fsdp_version"] = 2
    return dict(config, fsdp_config=out)


def load_config(path: str) -> dict[str, Any]:
    """The raw mapping of the YAML config at ``path`` (one-line errors for a missing or malformed file)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except FileNotFoundError:
        raise MissingFileError(f"--config_file {path} does not exist; pass the path of the FSDP1 config") from None
    except IsADirectoryError:
        raise HastenCLIError(f"--config_file {path} is a directory; pass the path of a YAML file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise HastenCLIError(f"--config_file {path} is not valid YAML{at}; fix the file") from None
    if not config:
        raise HastenCLIError(f"--config_file {path} is empty; pass a config written by `hasten config`")
    if not isinstance(config, dict):
        raise HastenCLIError(f"--config_file {path} holds a {type(config).__name__}, not a mapping of config keys")
    return config


def to_fsdp2_command(args: argparse.Namespace) -> int:
    from .config_schema import dump_yaml_atomically

    source = os.path.expanduser(args.config_file)
    target = os.path.expanduser(args.output_file) if args.output_file else None
    if not Path(source).exists():
        raise MissingFileError(f"--config_file {source} does not exist; pass the path of the FSDP1 config")
    if target is None and not args.overwrite:
        raise HastenCLIError("to-fsdp2 needs --output_file PATH, or --overwrite to replace --config_file")
    target = target or source
    if Path(target).exists() and not args.overwrite:
        raise FileInTheWayError(f"--output_file {target} already exists; pass --overwrite to replace it, or another path")
    converted = convert_config_to_fsdp2(load_config(source))
    print(dump_yaml_atomically(target, converted, flag="--output_file"))
    return 0
