"""Big-model inference: build a model without memory, load a checkpoint into it shard by shard, and
spread it over GPUs, CPU RAM and disk (Accelerate's ``big_modeling`` names and semantics).

A model built under ``init_empty_weights()`` has its parameters on the ``meta`` device (shapes
only). ``load_checkpoint_and_dispatch`` plans a device map (``"auto"``, ``"balanced"``,
``"sequential"`` or your dict), reads the checkpoint one shard at a time straight into place
(weights mapped to ``"disk"`` go to an offload folder as safetensors) and attaches hooks
(``hasten.hooks``) that move inputs between devices and load offloaded weights for each forward.
The same holds for FSDP2 with ``cpu_ram_efficient_loading``: process 0 fills the shards, so a job of
N processes on one machine holds one copy of the model in host memory, not N.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Union

from ._lazy import lazy_module

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from .hooks import UserCpuOffloadHook

# Accelerate's module also offers these two; they live in their own modules here, loaded on first use.
__getattr__, __dir__ = lazy_module(__name__, {"load_checkpoint_in_model": "hasten.model_loading",
                                              "attach_layerwise_casting_hooks": "hasten.layerwise_casting"})

PathLike = Union[str, "os.PathLike[str]"]
DeviceLike = Union[int, str, "torch.device"]
_PLANS = ("auto", "balanced", "balanced_low_0", "sequential")


def _include_buffers(include_buffers: Optional[bool]) -> bool:
    if include_buffers is not None:
        return include_buffers
    from .utils.environment import parse_flag

    return parse_flag("INIT_INCLUDE_BUFFERS", False)


@contextlib.contextmanager
def init_on_device(device: DeviceLike, include_buffers: Optional[bool] = None) -> Iterator[None]:
    """Create the parameters (and with ``include_buffers`` the buffers) of modules built inside on ``device``.

    include_buffers defaults to ``HASTEN_INIT_INCLUDE_BUFFERS`` / ``ACCELERATE_INIT_INCLUDE_BUFFERS``
    (else False).
    """
    import torch
    from torch import nn

    device = torch.device(device)
    if _include_buffers(include_buffers):
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: Any) -> None:
        original(module, name, param)
        if param is not None and param.device != device:  # an existing parameter (a tie) stays itself
            current = module._parameters[name]
            extra = dict(current.__dict__)  # attributes such as transformers' _is_hf_initialized
            moved = type(current)(current.to(device), requires_grad=param.requires_grad)
            for key, value in extra.items():
                setattr(moved, key, value)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_parameter  # buffers stay where they are created
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def init_empty_weights(include_buffers: Optional[bool] = None) -> Iterator[None]:
    """Build models whose parameters take no memory (``meta`` device); load weights with
    ``load_checkpoint_and_dispatch`` (or ``load_checkpoint_in_model``) afterwards."""
    with init_on_device("meta", include_buffers=include_buffers):
        yield


def _first_device(model: "nn.Module") -> "torch.device":
    import torch

    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def cpu_offload(model: "nn.Module", execution_device: Optional["torch.device"] = None, offload_buffers: bool = False,
                state_dict: Optional[dict[str, "torch.Tensor"]] = None,
                preload_module_classes: Optional[list[str]] = None) -> "nn.Module":
    """Keep all weights in CPU RAM (``state_dict``, default a CPU copy of the model's) and load each
    submodule's weights on ``execution_device`` (default: where the first parameter is) only for its forward.

    Outputs come back on the input's device. ``preload_module_classes``: see ``attach_align_device_hook``.
    """
    from .hooks import AlignDevicesHook, add_hook_to_module, attach_align_device_hook
    from .utils.modeling import find_tied_parameters, retie_parameters

    if execution_device is None:
        execution_device = _first_device(model)
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    tied = find_tied_parameters(model)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=state_dict, preload_module_classes=preload_module_classes)
    retie_parameters(model, tied)  # each hook put its own meta stand-in: make tied names one object again
    return model


def cpu_offload_with_hook(model: "nn.Module", execution_device: Optional[DeviceLike] = None,
                          prev_module_hook: Optional["UserCpuOffloadHook"] = None) -> tuple["nn.Module", "UserCpuOffloadHook"]:
    """Keep ``model`` on the CPU until its forward, then move it whole to ``execution_device`` (default:
    this process's device), where it stays until ``hook.offload()``.

    Chain models of a pipeline with ``prev_module_hook``: the previous model goes back to the CPU just
    before this one runs. Returns ``(model, hook)``.
    """
    from .hooks import CpuOffload, UserCpuOffloadHook, add_hook_to_module

    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(model: "nn.Module", offload_dir: PathLike, execution_device: Optional["torch.device"] = None,
                 offload_buffers: bool = False, preload_module_classes: Optional[list[str]] = None) -> "nn.Module":
    """Keep all weights in ``offload_dir`` (written there from the model unless the folder already has an
    index) and read each submodule's weights onto ``execution_device`` only for its forward."""
    from .hooks import AlignDevicesHook, add_hook_to_module, attach_align_device_hook
    from .utils.modeling import find_tied_parameters, retie_parameters
    from .utils.offload import INDEX_NAME, OffloadedWeightsLoader, offload_to_safetensors

    if not os.path.isfile(os.path.join(os.fspath(offload_dir), INDEX_NAME)):
        offload_to_safetensors(offload_dir, model.state_dict())
    if execution_device is None:
        execution_device = _first_device(model)
    tied = find_tied_parameters(model)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=OffloadedWeightsLoader(save_folder=offload_dir),
                             preload_module_classes=preload_module_classes)
    retie_parameters(model, tied)
    return model


def _is(device: Any, kind: str) -> bool:
    return isinstance(device, str) and device == kind or str(device) == kind


def _offloaded_names(model: "nn.Module", modules: list[str], offload_buffers: bool) -> list[str]:
    """State-dict names of the given modules that an offloading hook takes off the module."""
    from .utils.modeling import non_persistent_buffers, submodule_tensors

    names = dict.fromkeys(n for n, _ in model.named_parameters(remove_duplicate=False))
    if offload_buffers:
        skip = non_persistent_buffers(model, recurse=True)
        names.update(dict.fromkeys(n for n, _ in model.named_buffers() if n not in skip))
    return list(submodule_tensors(names, modules))


def _disjoint(model: "nn.Module", device_map: Mapping[str, Any]) -> dict[str, Any]:
    """``device_map`` with every entry that has more specific entries below it (``""`` next to
    ``"layers.3"``) replaced by its children and direct tensors, so that no entry contains another."""
    from .utils.modeling import named_module_tensors

    out = dict(device_map)
    while True:
        outer = [k for k in out if any(o != k and (not k or o.startswith(k + ".")) for o in out)]
        if not outer:
            return out
        for key in outer:
            device = out.pop(key)
            module = model.get_submodule(key)
            prefix = f"{key}." if key else ""
            names = [n for n, _ in module.named_children()] + [n for n, _ in named_module_tensors(module)]
            for name in names:
                out.setdefault(prefix + name, device)


def _prepare_disk_folder(model: "nn.Module", disk_modules: list[str], offload_dir: Optional[PathLike],
                         offload_index: Optional[Mapping], offload_buffers: bool) -> None:
    """Make sure the offload folder holds every weight of the disk modules (writing those it lacks)."""
    from .utils.offload import offload_to_safetensors, read_index

    if offload_dir is None and offload_index is None:
        raise ValueError(f"dispatch_model: device_map sends {disk_modules} to 'disk', so it needs offload_dir= (a "
                         "folder for their weights) or offload_index=")
    if offload_index is not None:
        return
    have = read_index(offload_dir)
    wanted = [n for n in _offloaded_names(model, disk_modules, offload_buffers) if n not in have]
    state = model.state_dict(keep_vars=True)
    on_meta = [n for n in wanted if n in state and state[n].device.type == "meta"]
    if on_meta:
        raise ValueError(f"dispatch_model: {on_meta[:5]} go to 'disk' but are neither in {os.fspath(offload_dir)!r} "
                         "nor loaded in the model (meta); load the checkpoint with load_checkpoint_and_dispatch or "
                         "load_checkpoint_in_model(..., offload_folder=) first")
    if wanted:
        offload_to_safetensors(offload_dir, {n: state[n].detach() for n in wanted if n in state})


def dispatch_model(
    model: "nn.Module",
    device_map: dict[str, DeviceLike],
    main_device: Optional["torch.device"] = None,
    state_dict: Optional[dict[str, "torch.Tensor"]] = None,
    offload_dir: Optional[PathLike] = None,
    offload_index: Optional[dict[str, str]] = None,
    offload_buffers: bool = False,
    skip_keys: Union[str, list[str], None] = None,
    preload_module_classes: Optional[list[str]] = None,
    force_hooks: bool = False,
) -> "nn.Module":
    """Place ``model`` as ``device_map`` says (``{module name: GPU index, "cpu", "disk" or device}``) and
    attach the hooks that make its forward work across those devices.

    Modules on a GPU stay there; with a GPU as ``main_device`` (default: the first GPU in the map)
    modules mapped to ``"cpu"`` keep their weights in RAM and run on it, loading them per forward;
    modules mapped to ``"disk"`` read theirs from ``offload_dir`` (written from the model if the
    folder lacks them). With everything on one device and no ``force_hooks`` the model is just moved
    there. Tied weights stay tied. Sets ``model.hf_device_map``, which transformers reads.
    """
    from .hooks import attach_align_device_hook_on_blocks
    from .utils.device_map import check_gpus_visible
    from .utils.modeling import _get_tensor, check_device_map, find_tied_parameters, retie_parameters, submodule_tensors
    from .utils.offload import OffloadedWeightsLoader

    check_device_map(model, device_map)
    check_gpus_visible(device_map)
    values = list(device_map.values())
    distinct = list(dict.fromkeys(values))
    if len(distinct) > 1 or any(_is(v, "disk") for v in values) or force_hooks:
        if main_device is None:
            accelerators = [v for v in distinct if not (_is(v, "cpu") or _is(v, "disk"))]
            main_device = accelerators[0] if accelerators else "cpu"
        on_host = _is(main_device, "cpu") or _is(main_device, "mps")
        blocks = _disjoint(model, device_map)  # "" next to "layers.3": "" stands for the rest only
        cpu_modules = [n for n, d in blocks.items() if _is(d, "cpu")]
        disk_modules = [n for n, d in blocks.items() if _is(d, "disk")]
        if not _is(main_device, "cpu") and state_dict is None and cpu_modules:
            kept = submodule_tensors(model.state_dict(), cpu_modules)
            state_dict = {n: t for n, t in kept.items() if t.device.type != "meta"}
        if disk_modules:
            _prepare_disk_folder(model, disk_modules, offload_dir, offload_index, offload_buffers)
        execution = {n: main_device if _is(d, "cpu") or _is(d, "disk") else d for n, d in blocks.items()}
        execution.setdefault("", main_device)
        offload = {n: _is(d, "disk") or (_is(d, "cpu") and not on_host) for n, d in blocks.items()}
        folder = offload_dir if disk_modules else None
        weights_map = None
        if state_dict is not None or folder is not None or offload_index is not None:
            weights_map = OffloadedWeightsLoader(state_dict=state_dict, save_folder=folder, index=offload_index,
                                                 device=main_device if offload_index is not None else None)
        tied = find_tied_parameters(model)
        # One entry per tied source with data, filled per device as hooks place it: tied weights
        # share one copy on each device instead of one per name.
        tied_params_map: dict[int, dict] = {}
        for group in tied:
            for name in group:
                tensor = _get_tensor(model, name)
                if tensor.device.type != "meta":
                    tied_params_map[tensor.data_ptr()] = {}
        attach_align_device_hook_on_blocks(model, execution_device=execution, offload=offload, weights_map=weights_map,
                                           offload_buffers=offload_buffers, skip_keys=skip_keys,
                                           preload_module_classes=preload_module_classes,
                                           tied_params_map=tied_params_map)
        retie_parameters(model, tied)
    else:
        device = values[0]
        model.to(f"cuda:{device}" if isinstance(device, int) and not isinstance(device, bool) else device)
    model.hf_device_map = dict(device_map)  # part of the API: transformers and users read it
    return model


def load_checkpoint_and_dispatch(
    model: "nn.Module",
    checkpoint: PathLike,
    device_map: Union[str, dict[str, DeviceLike], None] = None,
    max_memory: Optional[dict[Union[int, str], Union[int, str]]] = None,
    no_split_module_classes: Optional[list[str]] = None,
    offload_folder: Optional[PathLike] = None,
    offload_buffers: bool = False,
    dtype: Union[str, "torch.dtype", None] = None,
    offload_state_dict: Optional[bool] = None,
    skip_keys: Union[str, list[str], None] = None,
    preload_module_classes: Optional[list[str]] = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> "nn.Module":
    """Load ``checkpoint`` (a weights file, a sharded ``*.index.json`` or a folder) into ``model`` and dispatch it.

    device_map: ``"auto"`` / ``"balanced"`` (spread evenly over the GPUs, then CPU, then disk),
    ``"balanced_low_0"`` (GPU 0 as empty as possible), ``"sequential"`` (fill GPUs in order), or a
    dict as for ``dispatch_model``; None only loads the weights. max_memory and
    no_split_module_classes shape the plan (see ``infer_auto_device_map``). Shards are read one at a
    time and each tensor goes straight to its device, so host memory peaks near one shard plus
    what is meant to stay in RAM; weights mapped to ``"disk"`` go to ``offload_folder``. dtype casts
    floating-point weights. The other arguments are passed on to ``load_checkpoint_in_model`` and
    ``dispatch_model``.
    """
    from .model_loading import load_checkpoint_in_model
    from .utils.device_map import get_balanced_memory, infer_auto_device_map

    if isinstance(device_map, str):
        if device_map not in _PLANS:
            raise ValueError(f"device_map={device_map!r} is not a plan; use one of {', '.join(map(repr, _PLANS))} "
                             "or a dict {module name: device}")
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                                             dtype=dtype, low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                                           dtype=dtype, offload_buffers=offload_buffers)
    if offload_state_dict is None and device_map is not None and any(_is(d, "disk") for d in device_map.values()):
        offload_state_dict = True
    load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=offload_folder, dtype=dtype,
                             offload_state_dict=bool(offload_state_dict), offload_buffers=offload_buffers,
                             strict=strict, full_state_dict=full_state_dict, broadcast_from_rank0=broadcast_from_rank0)
    if device_map is None:
        return model
    return dispatch_model(model, device_map=device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
                          skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks)
