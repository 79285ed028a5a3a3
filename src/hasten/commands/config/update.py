"""``hasten config update``: rewrite a config in the current format, optionally changing keys."""

from __future__ import annotations

import argparse
from typing import Any

from ..config_schema import SECTIONS, read_config, validate, write_config
from ..errors import HastenCLIError, did_you_mean
from .paths import config_path_of


def update_command(args: argparse.Namespace) -> int:
    path = config_path_of(args)
    cfg = read_config(path)
    for change in args.changes:
        key, eq, value = change.partition("=")
        if not eq:
            raise HastenCLIError(f"{change!r} is not key=value; e.g. hasten config update num_processes=4")
        apply_change(cfg, key.strip(), value.strip())
    write_config(path, cfg)
    print(f"hasten: configuration updated at {path}")
    return 0


def apply_change(cfg: dict[str, Any], key: str, value: str) -> None:
    """``key=value`` from the command line (YAML value syntax; sections as ``section.key``)."""
    import yaml

    try:
        parsed = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        parsed = value
    section, dot, sub = key.partition(".")
    if dot:
        if section not in SECTIONS:
            hint = did_you_mean(section, list(SECTIONS))
            raise HastenCLIError(f"unknown config section {section!r}{hint or '; sections: ' + ', '.join(SECTIONS)}")
        cfg[section] = dict(cfg.get(section) or {}, **{sub: parsed})
    else:
        cfg[key] = parsed
    validate(cfg, f"hasten config update {key}={value}")
