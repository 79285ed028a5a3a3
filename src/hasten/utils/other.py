"""Model and process helpers that Accelerate scripts import from ``accelerate.utils``.

Each behaves as Accelerate's helper of the same name does; the docstrings say where hasten differs.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import socket
from typing import Any, Optional

import torch
from torch import nn

from ..compilation import compile_regions, has_repeated_blocks, is_repeated_blocks  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)


def _dynamo_optimized_module() -> Optional[type]:
    dynamo = getattr(torch, "_dynamo", None)
    return getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None) if dynamo is not None else None


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper that ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    wrapper = _dynamo_optimized_module()
    return wrapper is not None and isinstance(module, wrapper)


def unwrap_compiled(module: Any) -> Any:
    """The module inside ``torch.compile``'s wrapper (or inside Accelerate's ``compile_regions`` copy,
    which keeps the original as ``_orig_mod``); any other object as it is.

    The one place that strips compilation: strategies ask about the DDP/FSDP module under it (a
    compiled DDP model must still get ``no_sync``), and unwrapping helpers start from here.
    """
    if not isinstance(module, nn.Module):
        return module
    if is_compiled_module(module):
        return module._orig_mod
    if "_orig_mod" in module.__dict__ and has_compiled_regions(module):
        return module.__dict__["_orig_mod"]
    return module


def _compiled_in_place(module: nn.Module) -> bool:
    # nn.Module.compile() (what hasten's compile_regions uses) leaves the module itself and sets this.
    return getattr(module, "_compiled_call_impl", None) is not None


def has_compiled_regions(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` is compiled: wrapped by ``torch.compile`` (as Accelerate checks)
    or compiled in place with ``nn.Module.compile`` (what ``compile_regions`` does in hasten)."""
    if not module._modules:
        return False
    return any(is_compiled_module(sub) or _compiled_in_place(sub) for sub in module.modules())


def compile_regions_deepspeed(module: nn.Module, **compile_kwargs: Any) -> None:
    """Regional compilation in place, for the module inside a DeepSpeed engine (same as ``compile_regions``)."""
    compile_regions(module, **compile_kwargs)


def compile_regions_fsdp2(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Regional compilation in place, so hooks ``fully_shard`` adds later still run (same as ``compile_regions``)."""
    return compile_regions(module, **compile_kwargs)


def model_has_dtensor(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (tensor parallelism or FSDP2 shards)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def get_model_tp_size(model: nn.Module) -> Optional[int]:
    """The tensor-parallel degree a transformers model was loaded with (``tp_plan``), or None."""
    size = getattr(model, "tp_size", None)
    if size is not None:
        return size
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    return config.get("tp_size") if isinstance(config, dict) else getattr(config, "tp_size", None)


# Wrappers that keep the user's model as ``.module`` (matched by class name: no import of deepspeed).
_CONTAINERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "DeepSpeedEngine",
               "PipelineEngine")


def _is_container(model: Any) -> bool:
    names = {cls.__name__ for cls in type(model).__mro__}
    return any(name in names for name in _CONTAINERS) and isinstance(getattr(model, "module", None), nn.Module)


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> nn.Module:
    """The user's model inside DDP/DataParallel/FSDP1/DeepSpeed containers and a ``torch.compile`` wrapper.

    ``keep_fp32_wrapper=False`` also removes the autocast forward that ``prepare`` put on the model for
    mixed precision; ``keep_torch_compile=False`` returns the module inside ``torch.compile``'s wrapper;
    ``recursive=True`` also replaces every child that is such a container by its ``.module``. FSDP2 and
    tensor parallelism change the module in place (no container), so they are returned as they are.
    """
    inner = unwrap_compiled(model)
    compiled, model = (model if inner is not model else None), inner
    while _is_container(model):
        model = model.module
    if recursive:
        model = _unwrap_children(model)
    if not keep_fp32_wrapper:  # the model and its compiled form both stop autocasting, as in unwrap_model
        from ..precision import Precision

        for wrapped in (model, compiled) if compiled is not None else (model,):
            Precision.unwrap_forward(wrapped)
    if compiled is None or not keep_torch_compile:
        return model
    if is_compiled_module(compiled):
        compiled._orig_mod = model
    else:
        compiled.__dict__["_orig_mod"] = model
    return compiled


def _unwrap_children(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    for name, child in list(module.named_children()):
        inner = _unwrap_children(child)
        if inner is not child:
            setattr(module, name, inner)
    return module


def wait_for_everyone() -> None:
    """Block until every process reaches this call (``PartialState().wait_for_everyone()``)."""
    from ..state import PartialState

    PartialState().wait_for_everyone()


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """``state_dict`` with one name kept per shared storage (safetensors refuses aliases) and contiguous tensors."""
    owners: dict[tuple, list[str]] = {}
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            owners.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(name)
    dropped = [name for names in owners.values() if len(names) > 1 for name in names[1:]]
    for name in dropped:
        del state_dict[name]
    if dropped:
        logger.warning("Left out %s: they share storage with another entry (tied weights); reloading ties them "
                       "again where the model declares the tie", sorted(dropped))
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True``: tensors, containers and plain values, never arbitrary
    objects. Unlike Accelerate, ``weights_only=False`` is refused: hasten never unpickles freely."""
    if kwargs.get("weights_only", True) is False:
        raise ValueError("hasten.utils.load(weights_only=False) is refused: unpickling arbitrary objects runs code "
                         "from the file. Save tensors and plain values (hasten.utils.save, safetensors), or call "
                         "torch.load yourself on a file you trust")
    kwargs.pop("weights_only", None)
    from ..files import weights_only

    if kwargs:  # torch.load's other options (mmap, pickle arguments) are torch's own reader's
        return torch.load(f, map_location=map_location, weights_only=True, **kwargs)
    if isinstance(f, (str, os.PathLike)):  # a file: hasten's allow-list unpickler, sizes bounded by the file
        return weights_only.load(f, map_location=map_location)
    data = f.read()  # a file object: its bytes, bounded the same way
    return weights_only.load_bytes(data, getattr(f, "name", repr(f)), "torch.save", map_location=map_location)


def get_pretty_name(obj: Any) -> str:
    """``obj``'s qualified name, else its class's, else ``str(obj)``."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    for attribute in ("__qualname__", "__name__"):
        if hasattr(obj, attribute):
            return getattr(obj, attribute)
    return str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Copy ``source`` into ``destination``, merging nested dicts key by key; returns ``destination``."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def is_port_in_use(port: Optional[int] = None) -> bool:
    """Whether something listens on ``localhost:port`` (29500, the default rendezvous port, when None)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", 29500 if port is None else port)) == 0


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit below 1024 of it, e.g. ``'1.5 KB'``."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def check_os_kernel() -> None:
    """Warn on Linux kernels older than 5.5, under which distributed processes are known to hang."""
    info = platform.uname()
    found = re.search(r"\d+\.\d+\.\d+", info.release)
    if info.system != "Linux" or found is None:
        return
    from packaging.version import Version

    if Version(found.group()) < Version("5.5.0"):
        # The version inside the message itself (not a %s argument): log filters match record.msg.
        logger.warning(f"Linux kernel {found.group()} is older than 5.5.0, under which processes can hang; "
                       "upgrade the kernel")


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layer.0")``."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list:
    """Every module under ``model``, children before parents, ``model`` last (with dotted names when
    ``return_fqns``)."""
    stack, order = [("", model)], []
    while stack:
        name, module = stack.pop()
        order.append((name, module) if return_fqns else module)
        stack.extend((f"{name}.{child}" if name else child, sub) for child, sub in module.named_children())
    return order[::-1]


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (inside any parallel container) is a peft ``PeftModel``."""
    from .imports import is_peft_available

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
    """A gradient scaler for fp16 on this process's device (FSDP's sharded scaler under FSDP)."""
    from .dataclasses import DistributedType

    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)
    from ..state import PartialState

    return torch.amp.GradScaler(PartialState().device.type, **kwargs)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None) -> Any:
    """The autocast context for the current ``AcceleratorState``'s mixed precision (a no-op context
    unless ``native_amp`` and fp16/bf16)."""
    import contextlib

    from ..state import AcceleratorState

    state = AcceleratorState()
    kwargs = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else {}
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(state.mixed_precision)
    if not native_amp or dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=state.device.type, dtype=dtype, **kwargs)


# Accelerate has these names in this module; hasten keeps them elsewhere (see accelerate_paths).
from .accelerate_paths import names_from_utils  # noqa: E402 - after the module's own names

__getattr__ = names_from_utils(__name__, (
    "save",
))
