"""Which device the tests run on, as hasten picks it: ``torch_device``, ``device_count`` and
``memory_allocated_func`` (Accelerate's names)."""

from __future__ import annotations

from typing import Callable

import torch


def get_backend() -> tuple[str, int, Callable[[], int]]:
    """(device type, how many of them, a function returning the bytes allocated on the current one).

    The order is the one hasten's process state uses to pick a device: CUDA, then XPU, then MPS,
    else the CPU (one "device"). ``torch.cuda.device_count`` asks NVML, so CUDA is not initialised
    here (a forking launcher started later from the same process would be refused otherwise).
    """
    if torch.cuda.device_count() > 0 and torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.memory_allocated
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu", xpu.device_count(), xpu.memory_allocated
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps", 1, torch.mps.current_allocated_memory
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()
