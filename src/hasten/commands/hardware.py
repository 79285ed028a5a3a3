"""What this machine has, found without importing torch (the launcher decides before torch loads)."""

from __future__ import annotations

import glob
import os
from typing import Mapping, Optional


def _physical_nvidia_gpus() -> Optional[int]:
    """GPUs the NVIDIA driver exposes; None when no driver is visible at all."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    if glob.glob("/dev/nvidia[0-9]*"):
        return len(glob.glob("/dev/nvidia[0-9]*"))
    return None


def cuda_device_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """CUDA devices this process may use: the driver's count, narrowed by ``CUDA_VISIBLE_DEVICES``."""
    env = os.environ if environ is None else environ
    physical = _physical_nvidia_gpus()
    if not physical:
        return 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    count = 0
    for item in visible.split(","):
        item = item.strip()
        # CUDA stops at the first entry that is not a valid device.
        if not item or item.startswith("-") or (item.isdigit() and int(item) >= physical):
            break
        count += 1
    return count


def cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask, not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _meminfo(field: str) -> Optional[int]:
    """A ``/proc/meminfo`` field in bytes (Linux), if readable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_bytes(pages: str) -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
    except (ValueError, OSError, AttributeError):
        return None


def memory_bytes() -> Optional[int]:
    """Total RAM of the machine, if readable."""
    found = _meminfo("MemTotal")
    return found if found is not None else _sysconf_bytes("SC_PHYS_PAGES")


def available_memory_bytes() -> Optional[int]:
    """RAM a new allocation can get without swapping (Linux's MemAvailable), if readable; elsewhere
    psutil's figure when it is installed, else the free pages the system reports."""
    found = _meminfo("MemAvailable")
    if found is not None:
        return found
    try:
        import psutil
    except ImportError:
        return _sysconf_bytes("SC_AVPHYS_PAGES")
    return int(psutil.virtual_memory().available)
