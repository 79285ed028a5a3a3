"""``load_checkpoint_in_model``: weights from a file or a folder into a model (Accelerate's signature).

The checkpoint is a ``.safetensors`` file, a ``.bin``/``.pt`` state dict (read with
``weights_only=True``: no arbitrary unpickling), a sharded ``*.index.json``, or a folder holding
one of those under transformers' names. Everything is checked before the model changes; shards are
read one at a time. Tensors are copied into the model's existing parameters when device and dtype
already match (optimizers holding them keep working); otherwise, or when a parameter is on the
``meta`` device (``init_empty_weights``), the parameter is replaced, ties preserved.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Optional, Sequence, Union

from .saving import (
    ALIASES_KEY,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAVE_ID_KEY,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointMismatchError,
    LoadResult,
    PathLike,
    _listing,
    find_aliases,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch


class _Source(NamedTuple):
    path: str
    safe: bool
    shapes: dict[str, Optional[tuple]]  # name -> shape (None: not a tensor)
    data: Optional[dict]  # .bin contents (memory-mapped when possible); safetensors are read later


def _read_source(path: str) -> tuple[_Source, dict[str, str], Optional[str]]:
    """Names and shapes of one weights file, plus its recorded aliases and save id."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            metadata = f.metadata() or {}
        aliases = json.loads(metadata[ALIASES_KEY]) if ALIASES_KEY in metadata else {}
        return _Source(path, True, shapes, None), aliases, metadata.get(SAVE_ID_KEY)
    import torch

    try:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # saved without the zip format: cannot be memory-mapped
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{path!r} holds objects other than tensors and plain containers, so hasten will not unpickle "
            f"it (weights_only=True). If you trust the file, load it with torch.load(weights_only=False) "
            f"and call model.load_state_dict. Details: {e}"
        ) from e
    if not isinstance(data, Mapping) or any(isinstance(v, Mapping) for v in data.values()):
        inner = [k for k, v in data.items() if isinstance(v, Mapping)] if isinstance(data, Mapping) else []
        raise ValueError(
            f"{path!r} is not a state dict (name -> tensor)"
            + (f": {_listing(inner)} hold nested dicts; pass e.g. torch.load(...)[{inner[0]!r}] to "
               "model.load_state_dict instead" if inner else f" but a {type(data).__name__}")
        )
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in data.items()}
    return _Source(path, False, shapes, dict(data)), {}, None


def _checkpoint_sources(checkpoint: PathLike) -> tuple[list[_Source], dict[str, str]]:
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        candidates = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
        found = next((os.path.join(path, c) for c in candidates if os.path.isfile(os.path.join(path, c))), None)
        if found is None:
            raise FileNotFoundError(
                f"checkpoint directory {path!r} holds none of {', '.join(candidates)}; pass the directory "
                "given to save_model / save_pretrained, or the weights file itself"
            )
        path = found
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; pass a weights file or a directory")
    if not path.endswith(".index.json"):
        source, aliases, _ = _read_source(path)
        return [source], aliases
    with open(path, encoding="utf-8") as f:
        index = json.load(f)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"index {path!r} has no 'weight_map'; it is not a sharded checkpoint index")
    metadata = index.get("metadata") or {}
    aliases = dict(metadata.get(ALIASES_KEY) or {})
    save_id = metadata.get(SAVE_ID_KEY)
    directory = os.path.dirname(path)
    sources = []
    for filename in dict.fromkeys(index["weight_map"].values()):
        shard = os.path.join(directory, filename)
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"index {path!r} lists shard {filename!r}, which is missing; the checkpoint is incomplete")
        source, shard_aliases, shard_id = _read_source(shard)
        if save_id is not None and shard_id is not None and shard_id != save_id:
            raise RuntimeError(
                f"shard {shard!r} was written by a different save than index {path!r} (an interrupted "
                "save?); the checkpoint mixes two saves, save it again"
            )
        absent = [n for n, fn in index["weight_map"].items() if fn == filename and n not in source.shapes]
        if absent:
            raise ValueError(f"index {path!r} says {_listing(absent)} are in {filename!r}, but that file lacks them")
        aliases.update(shard_aliases)
        sources.append(source)
    return sources, aliases


def _unwrap(model: Any) -> Any:
    import torch

    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def _check_unsupported(device_map: Optional[Mapping[str, Any]], offload_folder: Optional[PathLike],
                       offload_buffers: bool, offload_8bit_bnb: bool) -> None:
    offloading = [name for name, device in (device_map or {}).items() if str(device) == "disk"]
    asked = [f"{name}={value!r}" for name, value in (("offload_folder", offload_folder), ("offload_buffers", offload_buffers),
                                                     ("offload_8bit_bnb", offload_8bit_bnb)) if value]
    if offloading or asked:
        what = f"device_map sends {_listing(offloading)} to 'disk'" if offloading else ", ".join(asked)
        raise NotImplementedError(
            f"load_checkpoint_in_model: {what}, but hasten does not offload weights to disk; map every module to a "
            "device or 'cpu' and leave offload_folder/offload_buffers/offload_8bit_bnb unset"
        )


def _device_for(name: str, device_map: Optional[Mapping[str, Any]]) -> Any:
    """The device ``device_map`` gives the tensor ``name`` (longest matching module prefix)."""
    if device_map is None:
        return None
    best = None
    for prefix in device_map:
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    if best is None:
        raise ValueError(
            f"load_checkpoint_in_model: device_map gives no device for {name!r}; add its module (or \"\" for "
            "everything else) to device_map"
        )
    device = device_map[best]
    return f"cuda:{device}" if isinstance(device, int) and not isinstance(device, bool) else device


def _target_dtype(name: str, value: "torch.Tensor", current: "torch.Tensor", dtype: Any,
                  keep_in_fp32_modules: Sequence[str]) -> "torch.dtype":
    import torch

    if not value.is_floating_point():
        return value.dtype
    if dtype is None:  # like load_state_dict: the model's dtype wins
        return current.dtype if current.is_floating_point() else value.dtype
    if any(module in name.split(".") for module in keep_in_fp32_modules):
        return torch.float32
    return getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype


class _Placer:
    """Puts checkpoint tensors into the model: copy in place when possible, else replace (keeping ties)."""

    def __init__(self, model: "torch.nn.Module", device_map: Optional[Mapping[str, Any]], dtype: Any,
                 keep_in_fp32_modules: Sequence[str]) -> None:
        self.model, self.device_map, self.dtype = model, device_map, dtype
        self.keep_in_fp32 = list(keep_in_fp32_modules)
        self.replaced: dict[int, Any] = {}  # id(old tensor) -> its replacement, for tied names

    def put(self, name: str, value: "torch.Tensor") -> None:
        import torch

        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        is_param = attr in module._parameters
        old = module._parameters[attr] if is_param else module._buffers[attr]
        if id(old) in self.replaced:  # a tie whose other name was loaded already
            new = self.replaced[id(old)]
        else:
            device = _device_for(name, self.device_map)
            if device is None:
                device = "cpu" if old.device.type == "meta" else old.device
            value = value.to(device=device, dtype=_target_dtype(name, value, old, self.dtype, self.keep_in_fp32))
            if old.device == value.device and old.dtype == value.dtype:
                with torch.no_grad():
                    old.copy_(value)
                return
            new = torch.nn.Parameter(value, requires_grad=old.requires_grad) if is_param else value
            self.replaced[id(old)] = new
        if is_param:
            module._parameters[attr] = new
        else:
            module._buffers[attr] = new


def load_checkpoint_in_model(
    model: "torch.nn.Module",
    checkpoint: PathLike,
    device_map: Optional[Mapping[str, Union[int, str, "torch.device"]]] = None,
    offload_folder: Optional[PathLike] = None,
    dtype: Union[str, "torch.dtype", None] = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Optional[list[str]] = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> LoadResult:
    """Load weights from ``checkpoint`` (file, sharded index or folder) into ``model``, in place.

    device_map: ``{module name: device}`` ("" for the whole model; an int is a CUDA index): each
    tensor goes to the device of its longest matching module, replacing meta or misplaced
    parameters. dtype: cast floating-point weights (``keep_in_fp32_modules`` names modules that stay
    float32); without it each weight takes the model's dtype, as with ``load_state_dict``.
    strict: missing or unexpected keys raise (default: a warning, and they are returned). Shapes
    must always match. Everything is checked before the model changes: one
    ``CheckpointMismatchError`` lists all problems. Tied names dropped at save time are restored.
    offload_state_dict is accepted (shards are read one at a time anyway); disk offloading
    (``offload_folder``, ``offload_buffers``, ``offload_8bit_bnb``, a "disk" device) is not supported
    and raises. full_state_dict / broadcast_from_rank0 concern sharded (DTensor) models only.
    Returns ``(missing_keys, unexpected_keys)``.
    """
    import torch

    model = _unwrap(model)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_checkpoint_in_model needs a torch.nn.Module, got a {type(model).__name__}")
    _check_unsupported(device_map, offload_folder, offload_buffers, offload_8bit_bnb)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise NotImplementedError(
            "load_checkpoint_in_model: the model is sharded (DTensor parameters); load the checkpoint into the "
            "unsharded model before preparing it, or use accelerator.load_state for a prepared one"
        )
    del offload_state_dict, full_state_dict, broadcast_from_rank0  # see the docstring
    sources, aliases = _checkpoint_sources(checkpoint)
    shapes: dict[str, Optional[tuple]] = {}
    for source in sources:
        for name, shape in source.shapes.items():
            shapes.setdefault(name, shape)
    restored = {a: c for a, c in aliases.items() if c in shapes and a not in shapes}
    for alias, canonical in restored.items():
        shapes[alias] = shapes[canonical]

    expected = model.state_dict(keep_vars=True)
    ties: dict[str, set[str]] = {}
    for name, twin in find_aliases(expected).items():
        group = ties.setdefault(twin, {twin}) | {name}
        for member in group:
            ties[member] = group
    missing = [k for k in expected if k not in shapes and not (ties.get(k, set()) & shapes.keys())]
    unexpected = [k for k in shapes if k not in expected]
    mismatched = [
        f"{k}: checkpoint {list(shapes[k])} vs model {list(expected[k].shape)}"
        for k in shapes
        if k in expected and shapes[k] is not None and isinstance(expected[k], torch.Tensor)
        and tuple(expected[k].shape) != shapes[k]
    ]
    problems = []
    if mismatched:
        problems.append(f"shapes differ for {_listing(mismatched)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listing(unexpected)}")
    if problems:
        hint = "" if mismatched else "; pass strict=False to load the keys that match"
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(checkpoint)!r} does not fit {type(model).__name__} (model unchanged): "
            + "; ".join(problems) + hint
        )
    for name in expected:
        _device_for(name, device_map)  # every tensor has a device before anything moves
    if missing or unexpected:
        warnings.warn(
            f"load_checkpoint_in_model: {os.fspath(checkpoint)!r} lacks {_listing(missing) if missing else 'nothing'} "
            f"and has extra {_listing(unexpected) if unexpected else 'nothing'} for {type(model).__name__}; the "
            "matching weights were loaded (strict=True makes this an error)", stacklevel=2,
        )

    placer = _Placer(model, device_map, dtype, keep_in_fp32_modules or [])
    for source in sources:
        if source.safe:
            from safetensors.torch import load_file

            data = load_file(source.path, device="cpu")
        else:
            data = source.data or {}
        for name, value in data.items():
            if name in expected:
                placer.put(name, value)
        for alias, canonical in restored.items():
            if canonical in data and alias in expected:
                placer.put(alias, data[canonical])
    return LoadResult(missing, unexpected)
