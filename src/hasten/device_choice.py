"""Which device a process uses and which process-group backend serves it.

``PartialState`` asks these once when it starts; FSDP2 asks ``serves_cpu_tensors`` before offloading.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .topology import Topology
from .utils.dataclasses import DistributedType
from .utils.environment import env_names, get_env, parse_flag

MULTI_TYPES = {
    "cuda": DistributedType.MULTI_GPU,
    "xpu": DistributedType.MULTI_XPU,
    "npu": DistributedType.MULTI_NPU,
    "mlu": DistributedType.MULTI_MLU,
    "musa": DistributedType.MULTI_MUSA,
    "hpu": DistributedType.MULTI_HPU,
    "cpu": DistributedType.MULTI_CPU,
}
_BACKENDS = {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo", "mps": "gloo"}


def choose_backend(device_type: str, cpu_offload: bool = False) -> str:
    """The process-group backend for ``device_type``.

    FSDP2's CPU offload keeps shards and gradients in host memory, and collectives then run on CPU
    tensors (the gradient-norm total, ``full_tensor()`` of a shard, rank 0's weights broadcast to the
    others): an accelerator's backend gets gloo beside it for those (``cuda:nccl,cpu:gloo``, as
    torchtitan and Accelerate do for offload). Only then: gloo needs its own connections, which a
    multi-node job may have to configure (``GLOO_SOCKET_IFNAME``).
    """
    backend = _BACKENDS.get(device_type, "gloo")
    if cpu_offload and backend != "gloo":
        return f"{device_type}:{backend},cpu:gloo"
    return backend


def serves_cpu_tensors(backend: str) -> bool:
    """Whether a process group made with ``backend`` runs collectives on CPU tensors."""
    return backend == "gloo" or "cpu:" in backend


def fsdp_wanted(fsdp_plugin: Any) -> tuple[bool, bool]:
    """(FSDP asked for, with CPU offload) from a plugin or, without one, ``hasten launch --use_fsdp``'s environment."""
    from .utils.fsdp_plugin import _flag, offloads_to_cpu

    if fsdp_plugin is None or fsdp_plugin == "from-environment":
        if fsdp_plugin is None and not parse_flag("USE_FSDP"):
            return False, False
        return True, _flag("offload_params", None)
    return True, offloads_to_cpu(getattr(fsdp_plugin, "cpu_offload", False))


def pick_device(topology: Topology, cpu: bool) -> torch.device:
    """``HASTEN_TORCH_DEVICE`` / ``ACCELERATE_TORCH_DEVICE`` when set (the device exactly, index
    included), else CUDA by local rank, then XPU, then MPS (single process), else CPU."""
    named = requested_device(cpu)
    if named is not None:
        return named
    if cpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        index = own_gpu(topology.local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        return torch.device("cuda", index)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return torch.device("xpu", topology.local_rank % max(1, xpu.device_count()))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available() and topology.world_size == 1:
        return torch.device("mps")
    return torch.device("cpu")


def requested_device(cpu: bool) -> Optional[torch.device]:
    """The device the environment names (``HASTEN_TORCH_DEVICE``, else ``ACCELERATE_TORCH_DEVICE``), or None."""
    raw = get_env("TORCH_DEVICE")
    if raw is None or not raw.strip():
        return None
    names = " / ".join(env_names("TORCH_DEVICE"))
    try:
        device = torch.device(raw.strip())
    except (RuntimeError, ValueError):
        raise ValueError(f"{names}={raw!r} is not a torch device; use a name such as 'cuda:1' or 'cpu'") from None
    if cpu and device.type != "cpu":
        raise ValueError(f"{names}={raw!r} contradicts cpu=True (or HASTEN_USE_CPU); unset one of them")
    return device


def own_gpu(local_rank: int, count: int, visible: Optional[str]) -> int:
    """The GPU of the process with ``local_rank`` on a node showing ``count`` GPUs: its local rank.

    Raises when the node has fewer GPUs than that: two processes on one GPU would hang in their first
    NCCL collective, so the process stops here and says how to start the job instead.
    """
    if local_rank < count:
        return local_rank
    raise RuntimeError(
        f"local rank {local_rank} has no GPU of its own: this node shows {count} CUDA device(s) "
        f"(CUDA_VISIBLE_DEVICES={visible!r}) and processes cannot share one. Start at most {count} process(es) "
        f"per node (hasten launch --num_processes {count}), or run on CPU (hasten launch --cpu, "
        "HASTEN_USE_CPU=1, or Accelerator(cpu=True))"
    )
