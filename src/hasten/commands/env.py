"""``hasten env``: everything a bug report needs, ready to paste."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any, Optional

from .errors import HastenCLIError
from .hardware import cpu_count, memory_bytes


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("env", help="Print versions, hardware and the effective config, for bug reports.")
    p.add_argument("--config_file", "--config-file", default=None, metavar="PATH",
                   help="Config file to show (default: the one hasten launch reads).")
    p.set_defaults(func=env_command)


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed or unreadable
        return "not installed"


def collect(config_file: Optional[str] = None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """(label, value) rows and the effective config; imports torch."""
    from .. import __accelerate_version__, __hasten_version__, __version__
    from .config import load_effective

    rows: list[tuple[str, str]] = [
        ("hasten", f"{__hasten_version__} (Accelerate API {__accelerate_version__}; package version {__version__})"),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("Platform", platform.platform()),
    ]
    try:
        import torch

        rows.append(("PyTorch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"))
        if torch.cuda.is_available():
            nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "unknown"
            rows.append(("CUDA / NCCL", f"{torch.version.cuda} / {nccl}"))
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                rows.append((f"GPU {i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
        else:
            rows.append(("GPUs", "none visible to torch"))
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            rows.append(("XPUs", str(xpu.device_count())))
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            rows.append(("MPS", "available"))
        rows.append(("torch.distributed", f"gloo={torch.distributed.is_gloo_available()}, "
                                          f"nccl={torch.distributed.is_nccl_available()}"))
    except ImportError:
        rows.append(("PyTorch", "not installed"))
    for name in ("numpy", "safetensors", "pyyaml", "accelerate", "transformers", "deepspeed"):
        rows.append((name, _version(name)))
    mem = memory_bytes()
    rows.append(("CPU", f"{platform.processor() or platform.machine()}, {cpu_count()} usable core(s) of {os.cpu_count()}"))
    rows.append(("RAM", f"{mem / 2**30:.1f} GiB" if mem else "unknown"))
    watched = sorted(k for k in os.environ if k.startswith(("HASTEN_", "ACCELERATE_")) or k in (
        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))
    rows.append(("Environment", ", ".join(f"{k}={os.environ[k]}" for k in watched) or "no HASTEN_/ACCELERATE_ variables"))
    try:
        path, cfg = load_effective(config_file)
        rows.append(("Config file", path or "none (hasten launch uses its defaults)"))
    except HastenCLIError as exc:  # a broken config is exactly what a bug report should show
        cfg = {}
        rows.append(("Config file", f"unreadable: {exc}"))
    return rows, cfg


def env_command(args: argparse.Namespace) -> int:
    from .config_schema import to_yaml_dict

    rows, cfg = collect(args.config_file)
    print("Copy everything below into your bug report.\n")
    for label, value in rows:
        print(f"- {label}: {value}")
    if cfg:
        import yaml

        print("- Config:")
        for line in yaml.safe_dump(to_yaml_dict(cfg), sort_keys=False).splitlines():
            print(f"    {line}")
    return 0
