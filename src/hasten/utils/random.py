"""Seeding and cross-process synchronisation of random number generators."""

from __future__ import annotations

import operator
import os
import random
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from ..state import PartialState
from .dataclasses import RNGType


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch on the CPU and every accelerator.

    Args:
        seed: the seed.
        device_specific: add this process's index to the seed, so that every process draws a
            different stream (e.g. for data augmentation); without it every process draws the same.
        deterministic: also make torch use deterministic algorithms (slower; cuDNN autotuning off).
    """
    if isinstance(seed, bool) or not hasattr(type(seed), "__index__"):
        raise TypeError(f"set_seed needs an integer seed, got {seed!r} ({type(seed).__name__}); pass e.g. set_seed(42)")
    seed = operator.index(seed)  # NumPy integers too
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # NumPy is optional
        pass
    else:
        np.random.seed(seed % 2**32)  # NumPy only takes 32-bit seeds
    # torch.manual_seed seeds the CPU and every accelerator torch knows (CUDA, MPS, XPU, custom backends).
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; torch raises without it.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)


def _rng_type(rng_type: Union[str, RNGType, None]) -> RNGType:
    choices = [t.value for t in RNGType]
    try:
        return RNGType(rng_type.lower() if isinstance(rng_type, str) else rng_type)
    except ValueError:
        raise ValueError(f"rng_type={rng_type!r} is not a known random number generator; choose one of {choices}") from None


def _device_module(name: str):  # noqa: ANN202 - torch.cuda or torch.xpu
    module = getattr(torch, name, None)
    if module is None or not module.is_available():
        raise ValueError(
            f"rng_type={name!r} but no {name.upper()} device is available here; "
            f"leave {name!r} out of rng_types on this machine"
        )
    return module


def synchronize_rng_state(rng_type: Union[str, RNGType, None] = None, generator: Optional[torch.Generator] = None) -> None:
    """Copy process 0's state of one random number generator to every process.

    ``rng_type`` is "torch" (the CPU generator), "cuda", "xpu" (the current device's generator) or
    "generator" (``generator``, e.g. a sampler's). With one process nothing changes.
    """
    kind = _rng_type(rng_type)
    if kind is RNGType.TORCH:
        rng_state = torch.get_rng_state()
    elif kind is RNGType.GENERATOR:
        if generator is None:
            raise ValueError("rng_type='generator' needs the generator to synchronise: pass generator=...")
        rng_state = generator.get_state()
    else:
        rng_state = _device_module(kind.value).get_rng_state()
    state = PartialState()
    if not state.use_distributed:
        return
    # NCCL only moves device tensors; gloo takes CPU ones.
    device = torch.device("cpu") if state.backend == "gloo" else state.device
    rng_state = rng_state.to(device)
    dist.broadcast(rng_state, src=0)
    rng_state = rng_state.cpu()
    if kind is RNGType.TORCH:
        torch.set_rng_state(rng_state)
    elif kind is RNGType.GENERATOR:
        generator.set_state(rng_state)
    else:
        _device_module(kind.value).set_rng_state(rng_state)


def synchronize_rng_states(rng_types: Iterable[Union[str, RNGType]], generator: Optional[torch.Generator] = None) -> None:
    """``synchronize_rng_state`` for each of ``rng_types``."""
    if isinstance(rng_types, (str, RNGType)):
        rng_types = [rng_types]
    kinds = [_rng_type(t) for t in rng_types]  # validate all before any collective
    for kind in kinds:
        synchronize_rng_state(kind, generator=generator)
