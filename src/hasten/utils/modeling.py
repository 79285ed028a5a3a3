"""Model tensors for big-model inference: placing one tensor, finding ties, measuring module sizes.

``set_module_tensor_to_device`` is the one place that swaps a parameter or buffer of a module
(``param.to(device)`` would make a new tensor the module does not see); the hooks, the checkpoint
loader and ``dispatch_model`` all go through it. Sizes follow Accelerate's conventions (a tied
parameter is counted once, under its first name; ``dtype`` only shrinks floating-point tensors) so
that device maps computed by either library agree. The device-map planner lives in
``hasten.utils.device_map``; its names are also reachable from this module, as in Accelerate.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Union

from .._lazy import lazy_module
from ..accelerate_channels import add_note, log_warning
from ..files.errors import CheckpointCorruptError
from ..files.weights import read_weights
from ..warning_kinds import HastenWarning

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

DeviceLike = Union[int, str, "torch.device"]

# Accelerate keeps the planner in this module; here it has its own module, imported on first use.
# The same holds for the checkpoint loader, the offload helpers and align_module_device.
__getattr__, __dir__ = lazy_module(__name__, {
    **{name: "hasten.utils.device_map" for name in ("get_max_memory", "get_balanced_memory", "infer_auto_device_map",
                                        "clean_device_map", "convert_file_size_to_int", "get_module_size_with_ties")},
    "load_checkpoint_in_model": "hasten.model_loading",
    "align_module_device": "hasten.hooks",
    **{name: "hasten.utils.offload_state" for name in ("get_state_dict_offloaded_model", "get_state_dict_from_offload")},
})


# -- dtypes -------------------------------------------------------------------------------------------
def to_dtype(dtype: Union[str, "torch.dtype", None]) -> Optional["torch.dtype"]:
    """``torch.float16`` from ``"float16"``, ``"torch.float16"`` or the dtype itself."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"dtype={dtype!r} is not a torch dtype; pass e.g. torch.float16 or 'bfloat16'")


def dtype_bytes(dtype: "torch.dtype") -> float:
    """Bytes one element of ``dtype`` takes (1/8 for bool, as Accelerate counts it)."""
    import torch

    if dtype == torch.bool:
        return 1 / 8
    return torch.empty((), dtype=dtype).element_size()


def dtype_byte_size(dtype: Union["torch.dtype", Any]) -> float:
    """Bytes one element of ``dtype`` (a torch dtype or a ``CustomDtype``) takes; sub-byte types give fractions."""
    from .kinds import CustomDtype

    custom = {CustomDtype.INT2: 1 / 4, CustomDtype.INT4: 1 / 2, CustomDtype.FP8: 1}
    if isinstance(dtype, CustomDtype):
        return custom[dtype]
    return dtype_bytes(dtype)


def id_tensor_storage(tensor: "torch.Tensor") -> tuple["torch.device", int, int]:
    """``(device, data pointer, bytes)`` of the storage under ``tensor``: equal for views of one storage.

    Unique only while the storage lives; every ``meta`` storage has pointer 0.
    """
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def is_cast_exempt(tensor: "torch.Tensor") -> bool:
    """Integer and bool tensors keep their dtype when a model is loaded in another dtype."""
    return not (tensor.is_floating_point() or tensor.is_complex())


# -- iterating tensors --------------------------------------------------------------------------------
def get_non_persistent_buffers(module: "nn.Module", recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers that ``state_dict`` leaves out: ``module``'s own, with ``recurse`` its
    submodules' too. fqns: dotted names relative to ``module`` (``"sub.mask"``) instead of the bare
    buffer names. Always a new set; the modules are not changed."""
    found = set()
    modules = module.named_modules() if recurse else [("", module)]
    for prefix, sub in modules:
        for name in getattr(sub, "_non_persistent_buffers_set", ()):
            found.add(f"{prefix}.{name}" if prefix and fqns else name)
    return found


def non_persistent_buffers(module: "nn.Module", recurse: bool = False) -> set[str]:
    """Dotted names (relative to ``module``) of buffers that ``state_dict`` leaves out."""
    return get_non_persistent_buffers(module, recurse, fqns=True)


def named_module_tensors(module: "nn.Module", include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Parameters, then (optionally) buffers of ``module``; a tied tensor appears once."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = non_persistent_buffers(module, recurse) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buffer


def _owner(module: "nn.Module", tensor_name: str) -> tuple["nn.Module", str]:
    """The submodule holding ``tensor_name`` ("a.b.weight" -> module a.b, "weight")."""
    *path, leaf = tensor_name.split(".")
    owner = module
    for i, part in enumerate(path):
        child = getattr(owner, part, None)
        if child is None:
            raise ValueError(f"{type(module).__name__} has no submodule {'.'.join(path[:i + 1])!r} "
                             f"(looking for tensor {tensor_name!r})")
        owner = child
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ValueError(f"{type(owner).__name__} {'.'.join(path) or '(root)'} has no parameter or buffer {leaf!r}")
    return owner, leaf


def _as_device(device: DeviceLike) -> "torch.device":
    import torch

    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)  # Accelerate's integers are accelerator indices
    return torch.device(device)


def _same_device(a: "torch.device", b: "torch.device") -> bool:
    if a.type != b.type:
        return False
    if a.type in ("cpu", "meta"):
        return True
    return (a.index or 0) == (b.index or 0)


def _rewrap(old: "torch.Tensor", data: "torch.Tensor") -> "torch.Tensor":
    """A parameter of ``old``'s class around ``data`` (attributes and ``requires_grad`` carried over)."""
    import torch

    kind = type(old)
    extra = {k: v for k, v in getattr(old, "__dict__", {}).items()}
    if kind is torch.nn.Parameter:
        new = torch.nn.Parameter(data, requires_grad=old.requires_grad)
    else:  # subclasses may take more constructor arguments: try the common form, else plain
        try:
            new = kind(data, requires_grad=old.requires_grad)
        except TypeError:
            new = torch.nn.Parameter(data, requires_grad=old.requires_grad)
    for key, value in extra.items():  # e.g. transformers' _is_hf_initialized
        if not hasattr(new, key):
            setattr(new, key, value)
    return new


def set_module_tensor_to_device(
    module: "nn.Module",
    tensor_name: str,
    device: DeviceLike,
    value: Optional["torch.Tensor"] = None,
    dtype: Union[str, "torch.dtype", None] = None,
    fp16_statistics: Optional["torch.HalfTensor"] = None,
    tied_params_map: Optional[dict[int, dict[Any, "torch.Tensor"]]] = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer ``tensor_name`` (dotted, relative to ``module``) on ``device``.

    value: the data to use (needed when the tensor is on ``meta``); its shape must match. Without
    ``dtype`` the value takes the existing tensor's dtype (as ``load_state_dict`` does); with it,
    floating-point values are cast to ``dtype``. A parameter stays a parameter of the same class
    with the same ``requires_grad``. tied_params_map: ``{data_ptr of the source: {device: tensor}}``;
    a source already placed on ``device`` is reused, so tied weights share one copy there.
    fp16_statistics is for bitsandbytes int8 weights, which hasten does not handle (must be None).
    clear_cache: empty the accelerator's cache afterwards when ``device`` is an accelerator.
    """
    import torch

    if fp16_statistics is not None:
        raise NotImplementedError("set_module_tensor_to_device: fp16_statistics (bitsandbytes int8 weights) is not "
                                  "supported by hasten; load the model without 8-bit quantization")
    owner, leaf = _owner(module, tensor_name)
    is_buffer = leaf in owner._buffers
    old = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]
    target = _as_device(device)
    source = value if value is not None else old

    if tied_params_map is not None and source is not None and source.device.type != "meta":
        shared = tied_params_map.get(source.data_ptr(), {}).get(device)
        if shared is not None:  # a tied twin already lives on this device: share it
            if is_buffer:
                owner._buffers[leaf] = shared
            else:
                owner._parameters[leaf] = shared
            return
    if old is None:
        raise ValueError(f"{tensor_name!r} is None in {type(owner).__name__}; there is no tensor to place")
    if value is None and old.device.type == "meta" and target.type != "meta":
        raise ValueError(f"{tensor_name!r} is on the meta device (no data); pass value= to put it on {target}")
    cast = to_dtype(dtype)

    with torch.no_grad():
        if value is not None:
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            if tuple(value.shape) != tuple(old.shape):
                # str() is Accelerate's sentence, which code written for Accelerate compares; the fix is a note.
                error = ValueError(f'Trying to set a tensor of shape {value.shape} in "{leaf}" (which has shape '
                                   f'{old.shape}), this looks incorrect.')
                add_note(error, f"{tensor_name!r} of {type(module).__name__} is {list(old.shape)}, the value "
                                f"{list(value.shape)}: the value (checkpoint) does not belong to this model")
                raise error
            want = old.dtype if cast is None else (value.dtype if is_cast_exempt(value) else cast)
            new = value.to(device=target, dtype=want, non_blocking=non_blocking)
        else:
            new = old.to(target, non_blocking=non_blocking)
            if cast is not None and target.type == "meta" and not is_cast_exempt(old):
                new = new.to(cast)
        if is_buffer:
            owner._buffers[leaf] = new
        elif value is not None or new is not old:
            # Keep the very parameter object when nothing changed (optimizers and ties hold it).
            owner._parameters[leaf] = _rewrap(old, new.detach() if isinstance(new, torch.nn.Parameter) else new)
    placed = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]
    if clear_cache and target.type not in ("cpu", "meta"):
        from .memory import clear_device_cache

        clear_device_cache()
    if tied_params_map is not None and source is not None and source.device.type != "meta":
        entry = tied_params_map.get(source.data_ptr())
        if entry is not None:
            entry.setdefault(device, placed)


# -- ties ---------------------------------------------------------------------------------------------
def find_tied_parameters(model: "nn.Module", **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that are the same parameter object, each group sorted.

    ``model.lm_head.weight = model.embed.weight`` gives ``[["embed.weight", "lm_head.weight"]]``.
    (Keyword arguments are accepted for Accelerate's signature and ignored.)
    """
    del kwargs
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [sorted(group) for group in names.values() if len(group) > 1]


def check_tied_parameters_in_config(model: "nn.Module") -> bool:
    """Whether a transformers model's config or modules say that some of its weights should be tied
    (tied word embeddings with an output embedding, a tied encoder/decoder, or a module with
    ``_tie_weights``). Always False for models that are not a ``PreTrainedModel``."""
    if "PreTrainedModel" not in {cls.__name__ for cls in type(model).__mro__}:
        return False
    config = getattr(model, "config", None)
    text_config = config
    if config is not None and hasattr(config, "get_text_config"):
        text_config = config.get_text_config(decoder=True)
    ties_embeddings = bool(text_config is not None and getattr(text_config, "tie_word_embeddings", False)
                           and model.get_output_embeddings() is not None)
    ties_encoder = bool(config is not None and getattr(config, "is_encoder_decoder", False)
                        and getattr(config, "tie_encoder_decoder", False))
    return ties_embeddings or ties_encoder or any(hasattr(m, "_tie_weights") for m in model.modules())


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: Mapping[str, Any]) -> None:
    """Log a WARNING (on ``hasten.utils.modeling``, as Accelerate logs it) for each group of tied parameters
    that ``device_map`` spreads over several devices (ValueError when a name has no device in the map)."""
    for group in tied_params:
        devices = {}
        for name in group:
            try:
                devices[name] = device_for(name, device_map)
            except KeyError:
                raise ValueError(f"device_map gives no device for tied parameter {name!r}; add its module "
                                 "(or \"\" for everything not listed)") from None
        if len(set(devices.values())) > 1:
            log_warning("hasten.utils.modeling", f"Tied parameters are on different devices: {devices}; put their "
                                                 "modules on one device in the device_map, or use device_map='auto'")


def _get_tensor(model: "nn.Module", name: str) -> "torch.Tensor":
    owner, leaf = _owner(model, name)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def put_tensor(model: "nn.Module", name: str, tensor: Optional["torch.Tensor"]) -> None:
    """Set parameter or buffer ``name`` of ``model`` to exactly ``tensor`` (no copy, no re-wrapping)."""
    owner, leaf = _owner(model, name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor
    else:
        owner._buffers[leaf] = tensor


def retie_parameters(model: "nn.Module", tied_params: list[list[str]]) -> None:
    """Make every name of each group point at one parameter again: one holding data if there is
    one, else the first (so tied weights offloaded to ``meta`` stay one object too)."""
    for group in tied_params:
        tensors = [_get_tensor(model, name) for name in group]
        keep = next((t for t in tensors if t is not None and t.device.type != "meta"), tensors[0] if tensors else None)
        if keep is None:
            continue
        for name in group:
            put_tensor(model, name, keep)


# -- sizes --------------------------------------------------------------------------------------------
def compute_module_sizes(
    model: "nn.Module",
    dtype: Union[str, "torch.dtype", None] = None,
    special_dtypes: Optional[Mapping[str, Union[str, "torch.dtype"]]] = None,
    buffers_only: bool = False,
) -> defaultdict[str, int]:
    """Bytes held by every module, parameter and buffer name (and ``""``: the whole model).

    Works on ``meta`` models. A tied parameter counts once. With ``dtype``, floating-point tensors
    count at the smaller of their own and ``dtype``'s element size (integer tensors are never
    cast); ``special_dtypes`` gives the dtype of individual tensor names.
    """
    cast = to_dtype(dtype)
    special = {name: to_dtype(d) for name, d in (special_dtypes or {}).items()}
    sizes: defaultdict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            per = dtype_bytes(special[name])
        elif cast is None or is_cast_exempt(tensor):
            per = dtype_bytes(tensor.dtype)
        else:
            per = min(dtype_bytes(cast), dtype_bytes(tensor.dtype))
        size = tensor.numel() * per
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def calculate_maximum_sizes(model: "nn.Module") -> tuple[int, tuple[int, list[str]]]:
    """The model's total size in bytes, and ``(size, names)`` of its largest layers (a layer is a leaf
    module, a tensor, or a module of a class in ``model._no_split_modules``)."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    top = (list(model.named_parameters(recurse=False)) + list(model.named_children())
           + list(model.named_buffers(recurse=False)))
    return sizes[""], get_max_layer_size(top, sizes, no_split)


def get_max_layer_size(modules: list[tuple[str, Any]], module_sizes: dict[str, int],
                       no_split_module_classes: list[str]) -> tuple[int, list[str]]:
    """Size and names of the largest layers among ``modules``: a layer is a module without children,
    a tensor, or a module of a class in ``no_split_module_classes``."""
    from torch import nn

    best, names = 0, []
    stack = list(modules)
    while stack:
        name, node = stack.pop(0)
        children = list(node.named_children()) if isinstance(node, nn.Module) else []
        if children and type(node).__name__ not in no_split_module_classes:
            stack = [(f"{name}.{n}", c) for n, c in children] + stack
            continue
        size = module_sizes[name]
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


def compute_module_total_buffer_size(model: "nn.Module", dtype: Union[str, "torch.dtype", None] = None,
                                     special_dtypes: Optional[Mapping[str, Union[str, "torch.dtype"]]] = None) -> int:
    """Bytes held by all buffers of ``model``."""
    return compute_module_sizes(model, dtype, special_dtypes, buffers_only=True).get("", 0)


# -- device maps --------------------------------------------------------------------------------------
def device_for(name: str, device_map: Mapping[str, Any]) -> Any:
    """The entry of ``device_map`` that covers tensor or module ``name`` (longest prefix), or KeyError."""
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            raise KeyError(name)
        probe = probe.rpartition(".")[0]


def check_device_map(model: "nn.Module", device_map: Mapping[str, DeviceLike]) -> None:
    """Raise if a tensor of ``model``'s state dict has no device in ``device_map``."""
    import warnings

    modules = dict(model.named_modules())
    def names_a_tensor(key: str) -> bool:  # "layer.weight": a direct parameter or buffer of a submodule
        parent, _, leaf = key.rpartition(".")
        owner = modules.get(parent)
        return owner is not None and (leaf in owner._parameters or leaf in owner._buffers)

    unknown = [k for k in device_map if k and k not in modules and not names_a_tensor(k)]
    if unknown:
        warnings.warn(f"device_map keys do not match any submodules (or tensors) of {type(model).__name__}: {unknown}; "
                      "those entries are unused (name modules as model.named_modules() does)", HastenWarning,
                      stacklevel=3)
    uncovered = []
    for name in model.state_dict():
        try:
            device_for(name, device_map)
        except KeyError:
            uncovered.append(name)
    if uncovered:
        shown = ", ".join(uncovered[:10]) + (f" and {len(uncovered) - 10} more" if len(uncovered) > 10 else "")
        raise ValueError(f"device_map gives no device for {shown}; add their modules to device_map (or \"\" for "
                         "everything not listed)")


def submodule_tensors(state_dict: Mapping[str, Any], module_names: list[str]) -> dict[str, Any]:
    """The entries of ``state_dict`` that belong to the given modules (``"h.1"`` does not match ``"h.10"``)."""
    out = {}
    for name in module_names:
        for key, value in state_dict.items():
            if not name or key == name or key.startswith(name + "."):
                out[key] = value
    return out



def extract_submodules_state_dict(state_dict: Mapping[str, Any], submodule_names: list[str]) -> dict[str, Any]:
    """The entries of ``state_dict`` under the named submodules (an empty name selects nothing)."""
    return submodule_tensors(state_dict, [name for name in submodule_names if name])


# -- checkpoint files ---------------------------------------------------------------------------------
def load_state_dict(checkpoint_file: str, device_map: Optional[Mapping[str, DeviceLike]] = None) -> dict[str, Any]:
    """The tensors of one checkpoint file: safetensors, or a torch ``.bin`` read with ``weights_only=True``.

    With ``device_map`` (module name -> device), safetensors weights are read straight onto their
    device; weights mapped to ``"disk"`` or to no module land on the CPU. ``.bin`` files always load
    on the CPU. A safetensors file must have been saved from PyTorch (metadata format ``pt``).
    """
    import torch

    checkpoint_file = str(checkpoint_file)
    if not checkpoint_file.endswith(".safetensors"):
        import pickle

        from ..files import weights_only

        try:  # hasten's allow-list unpickler: every size the file states bounded by the file
            return weights_only.load(checkpoint_file)
        except weights_only.unpickling.ForbiddenGlobal as e:  # Accelerate's (torch's) words first: scripts match them
            raise type(e)(f"Weights only load failed: {e}") from None
        except (pickle.UnpicklingError, OSError):
            raise  # they name what was refused, or the file
        except Exception as e:  # noqa: BLE001 - EOFError, zip errors, ...: none names the file
            if isinstance(e, CheckpointCorruptError):
                raise
            raise CheckpointCorruptError(f"cannot read {checkpoint_file!r} ({type(e).__name__}: {e}); the file is "
                                         "damaged or not a torch state dict") from None
    import warnings

    view = read_weights(checkpoint_file).view  # a plain file, read once, verified: the tensors come from it
    metadata = view.metadata or None
    names = list(view.entries)
    if metadata is None:
        warnings.warn(f"{checkpoint_file} has no safetensors metadata; reading it as a PyTorch checkpoint",
                      HastenWarning, stacklevel=2)
        metadata = {"format": "pt"}
    if metadata.get("format") not in ("pt", "tf", "flax"):
        raise OSError(f"{checkpoint_file} has safetensors metadata format={metadata.get('format')!r}, not 'pt', 'tf' "
                      "or 'flax'; save it with save_pretrained or safetensors.torch.save_file")
    if metadata["format"] != "pt":
        raise ValueError(f"{checkpoint_file} was saved from {metadata['format']}; convert it to a PyTorch checkpoint "
                         "(metadata format 'pt') first")
    devices = set((device_map or {}).values())
    placement: dict[str, Any] = {}
    for name in names:
        if device_map is None:
            device = "cpu"
        elif len(devices) == 1 and "disk" not in devices:
            device = next(iter(devices))  # one device: every tensor goes there, mapped or not
        else:
            try:
                device = device_for(name, device_map)
            except KeyError:
                device = "cpu"
        placement[name] = "cpu" if device == "disk" else device
    tensors: dict[str, Any] = {}
    for name in names:
        tensor = view.tensor(name)
        device = _as_device(placement[name])
        tensors[name] = tensor if tensor.device == device else tensor.to(device)
    return tensors
