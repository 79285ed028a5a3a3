"""``load_checkpoint_in_model``: weights from a file or a folder into a model (Accelerate's signature).

The checkpoint is a ``.safetensors`` file, a ``.bin``/``.pt`` state dict (read with
``weights_only=True``: no arbitrary unpickling), a sharded ``*.index.json``, or a folder holding
one of those under transformers' names. Everything is checked before the model changes; shards are
read one at a time. Tensors are copied into the model's existing parameters when device and dtype
already match (optimizers holding them keep working); otherwise, or when a parameter is on the
``meta`` device (``init_empty_weights``), the parameter is replaced, ties preserved.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence, Union

from .saving import CheckpointMismatchError, LoadResult, PathLike, _listing, find_aliases
from .warning_kinds import HastenWarning
from .weights_sources import (  # noqa: F401 - read_weights_index, verify_weights_file, _read_source: public here
    Source,
    checkpoint_sources,
    fit_problems,
    log_partial_load,
    read_weights_index,
    verify_weights_file,
)
from .weights_sources import read_source as _read_source  # noqa: F401 - tests and older callers
from .strategies.shard_loading import load_into_sharded

if TYPE_CHECKING:  # pragma: no cover
    import torch


def _unwrap(model: Any) -> Any:
    import torch

    from .utils.other import unwrap_compiled

    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif unwrap_compiled(model) is not model:
            model = unwrap_compiled(model)
        else:
            return model


def _check_offload(device_map: Optional[Mapping[str, Any]], offload_folder: Optional[PathLike],
                   offload_8bit_bnb: bool) -> None:
    if offload_8bit_bnb:
        raise NotImplementedError("load_checkpoint_in_model: offload_8bit_bnb=True needs bitsandbytes int8 modules, "
                                  "which hasten does not support; leave offload_8bit_bnb=False")
    on_disk = [name for name, device in (device_map or {}).items() if str(device) == "disk"]
    if on_disk and offload_folder is None:
        raise ValueError(f"load_checkpoint_in_model: device_map sends {_listing(on_disk)} to 'disk'; pass "
                         "offload_folder= (a folder for their weights)")


def _check_ties(ties: Mapping[str, set], device_map: Optional[Mapping[str, Any]]) -> None:
    """Tied names must agree about the disk: one copy cannot be both offloaded and in memory."""
    if not device_map:
        return
    for group in {frozenset(g) for g in ties.values()}:
        devices = {name: str(_device_for(name, device_map)) for name in sorted(group)}
        if len(set(devices.values())) > 1:
            if "disk" in devices.values():
                raise ValueError(f"load_checkpoint_in_model: tied weights {devices} are mapped to 'disk' and to other "
                                 "devices; put the modules holding them on the same device (infer_auto_device_map "
                                 "does this)")
            warnings.warn(f"load_checkpoint_in_model: tied weights {devices} are mapped to different devices; they "
                          "stay tied, on the device of the first one loaded", HastenWarning, stacklevel=3)


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
    """Puts checkpoint tensors into the model: copy in place when possible, else replace (keeping ties).

    Tensors mapped to ``"disk"`` are collected per shard (``flush`` writes them to the offload folder)
    and leave a ``meta`` tensor of the loaded dtype in the model.
    """

    def __init__(self, model: "torch.nn.Module", device_map: Optional[Mapping[str, Any]], dtype: Any,
                 keep_in_fp32_modules: Sequence[str], offload_folder: Optional[PathLike] = None,
                 offload_buffers: bool = False) -> None:
        self.model, self.device_map, self.dtype = model, device_map, dtype
        self.keep_in_fp32 = list(keep_in_fp32_modules)
        self.replaced: dict[int, Any] = {}  # id(old tensor) -> its replacement, for tied names
        self.offload_folder, self.offload_buffers = offload_folder, offload_buffers
        self.parked: dict[int, tuple[Any, str]] = {}  # id(old tensor) -> (meta stand-in, first name)
        self.pending: dict[str, Any] = {}  # name -> CPU tensor to write with the next flush
        self.late_aliases: dict[str, str] = {}  # tied name -> its twin written by an earlier flush
        self.written: dict[str, dict] = {}  # name -> offload index entry

    def _park(self, name: str, value: "torch.Tensor", old: "torch.Tensor", is_param: bool) -> "torch.Tensor":
        import torch

        first = self.parked.get(id(old))
        if first is not None:  # a tie: store once, index both names
            meta, first_name = first
            if first_name in self.pending:
                self.pending[name] = self.pending[first_name]
            else:
                self.late_aliases[name] = first_name
            return meta
        stored = value.to(device="cpu", dtype=_target_dtype(name, value, old, self.dtype, self.keep_in_fp32))
        meta = stored.to("meta")
        if is_param:
            meta = torch.nn.Parameter(meta, requires_grad=old.requires_grad)
        self.parked[id(old)] = (meta, name)
        self.pending[name] = stored
        return meta

    def flush(self) -> None:
        """Write the disk-bound tensors collected so far (one file per shard) and index them."""
        if not self.pending and not self.late_aliases:
            return
        from .utils.offload import add_to_index, write_offload_file

        entries = write_offload_file(self.offload_folder, self.pending)
        for alias, first in self.late_aliases.items():
            entries[alias] = dict(self.written[first])
        self.written.update(entries)
        add_to_index(self.offload_folder, entries)
        self.pending, self.late_aliases = {}, {}

    def parks(self, name: str) -> bool:
        """Whether tensor ``name`` (or one of its tied names) goes to the offload folder."""
        if not self.device_map or str(_device_for(name, self.device_map)) != "disk":
            return False
        module_name, _, attr = name.rpartition(".")
        return self.offload_buffers or attr in self.model.get_submodule(module_name)._parameters

    def put(self, name: str, value: "torch.Tensor") -> None:
        import torch

        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        is_param = attr in module._parameters
        old = module._parameters[attr] if is_param else module._buffers[attr]
        device = _device_for(name, self.device_map)
        if str(device) == "disk" and (is_param or self.offload_buffers):
            new = self._park(name, value, old, is_param)
        elif id(old) in self.replaced:  # a tie whose other name was loaded already
            new = self.replaced[id(old)]
        else:
            if str(device) == "disk":  # a buffer that is not offloaded: it stays in RAM
                device = "cpu"
            if device is None:
                device = "cpu" if old.device.type == "meta" else old.device
            value = value.to(device=device, dtype=_target_dtype(name, value, old, self.dtype, self.keep_in_fp32))
            if old.device == value.device and old.dtype == value.dtype:
                with torch.no_grad():
                    old.copy_(value)
                return
            if self.offload_folder is not None and value.untyped_storage().nbytes() > value.nbytes:
                value = value.clone()  # a view of the shard's bytes would keep its disk-bound tensors in RAM too
            new = torch.nn.Parameter(value, requires_grad=old.requires_grad) if is_param else value
            self.replaced[id(old)] = new
        if is_param:
            module._parameters[attr] = new
        else:
            module._buffers[attr] = new


def _tensors(source: Source, wanted: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of one weights file, in file order (only names ``wanted`` accepts): views of
    the verified bytes of a safetensors file, the contents of a ``.bin``."""
    if not source.safe:
        yield from ((n, v) for n, v in (source.data or {}).items() if wanted(n))
        return
    view = source.view
    for name in sorted(view.entries, key=lambda n: view.entries[n]["data_offsets"][0]):
        if wanted(name):
            yield name, view.tensor(name)


def _refuse_placement(device_map: Any, offload_folder: Any, dtype: Any, keep_in_fp32_modules: Any, model: str) -> None:
    """Placement and dtype options cannot apply to a model ``prepare()`` already laid out (``model`` says which)."""
    given = {"device_map": device_map, "offload_folder": offload_folder, "dtype": dtype,
             "keep_in_fp32_modules": keep_in_fp32_modules}
    unsupported = [k for k, v in given.items() if v]
    if unsupported:
        raise ValueError(f"load_checkpoint_in_model: {', '.join(unsupported)} cannot apply to {model}; leave them "
                         "out (the model's dtype wins), or load before preparing")


def _load_sharded(model: "torch.nn.Module", checkpoint: PathLike, device_map: Any, offload_folder: Any, dtype: Any,
                  keep_in_fp32_modules: Any, strict: bool) -> LoadResult:
    """A prepared model (FSDP2, tensor parallel): each process reads the slices of its shards."""
    _refuse_placement(device_map, offload_folder, dtype, keep_in_fp32_modules,
                      "a prepared (sharded) model, whose layout and dtype prepare() fixed")
    return load_into_sharded(model, checkpoint, strict)


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
    Tensors are read one at a time (shard by shard), so host memory holds what stays in RAM plus
    one tensor, and for weights mapped to ``"disk"`` one shard's share of them: those are written
    as safetensors to ``offload_folder`` (see ``hasten.utils.offload``) and left on ``meta`` in the
    model, for ``dispatch_model`` to load per forward. Buffers mapped to ``"disk"`` stay in RAM unless
    ``offload_buffers``. offload_state_dict is accepted and needs no action (nothing is held beyond
    one tensor); offload_8bit_bnb (bitsandbytes) raises. full_state_dict / broadcast_from_rank0
    are accepted for Accelerate's signature and need no action.

    A prepared model (FSDP2, tensor parallel, HSDP, dp_shard x tp: DTensor parameters), possibly
    still on ``meta`` (built under ``init_empty_weights()`` on every process), is filled in place
    with each process reading only the slices of its own shards; every process must call it then,
    and every process raises when one fails. Its parameters on ``meta`` must all be in the
    checkpoint (whatever ``strict``).
    Returns ``(missing_keys, unexpected_keys)``.
    """
    import torch

    model = _unwrap(model)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_checkpoint_in_model needs a torch.nn.Module, got a {type(model).__name__}")
    _check_offload(device_map, offload_folder, offload_8bit_bnb)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return _load_sharded(model, checkpoint, device_map, offload_folder, dtype, keep_in_fp32_modules, strict)
    del offload_state_dict, full_state_dict, broadcast_from_rank0  # see the docstring
    if hasattr(model, "local_stages") and hasattr(model, "full_state_names"):  # a prepared pipeline
        return _load_stages(model, checkpoint, device_map, offload_folder, dtype, keep_in_fp32_modules, strict)
    return _load_plain(model, checkpoint, device_map, offload_folder, dtype, offload_buffers, keep_in_fp32_modules,
                       strict)


def _load_stages(model: "torch.nn.Module", checkpoint: PathLike, device_map: Any, offload_folder: Any, dtype: Any,
                 keep_in_fp32_modules: Any, strict: bool) -> LoadResult:
    """A model prepared for pipeline parallelism: this process's stages (the full model's names) take
    their own tensors from the checkpoint, in place, in one pass over its files (all stages checked
    before any changes); the other stages' names are not unexpected."""
    _refuse_placement(device_map, offload_folder, dtype, keep_in_fp32_modules,
                      "a model prepared for pipeline parallelism, whose stages prepare() placed (and whose parameters "
                      "its optimizer and schedule hold)")
    view = _stages_view(model)
    result = _load_plain(view, checkpoint, None, None, None, False, None, strict, known=model.full_state_names)
    model.filled(set(view.state_dict()) - set(result[0]))  # tensors built on meta that now hold values
    return result


def _stages_view(model: "torch.nn.Module") -> "torch.nn.Module":
    """One module holding every local stage's modules under their names in the full model: plain
    containers down to the modules that hold parameters or buffers themselves, which are the stages'
    own (so what is loaded into the view is loaded into the stages)."""
    import torch

    root = torch.nn.Module()

    def attach(path: str, module: "torch.nn.Module") -> None:
        if not path:  # a stage's root: its own tensors (the same objects) on the view's root
            root._parameters.update(module._parameters)
            root._buffers.update(module._buffers)
            root._non_persistent_buffers_set |= module._non_persistent_buffers_set
        elif module._parameters or module._buffers or not module._modules:
            parent, _, leaf = path.rpartition(".")
            holder = root
            for part in parent.split(".") if parent else []:
                if part not in holder._modules:
                    holder._modules[part] = torch.nn.Module()
                holder = holder._modules[part]
            holder._modules[leaf] = module
            return
        for name, child in module._modules.items():
            if child is not None:
                attach(f"{path}.{name}" if path else name, child)

    for _, stage in model.local_stages():
        attach("", stage)
    return root


def _load_plain(model: "torch.nn.Module", checkpoint: PathLike, device_map: Any, offload_folder: Any, dtype: Any,
                offload_buffers: bool, keep_in_fp32_modules: Any, strict: bool,
                known: Any = frozenset()) -> LoadResult:
    """``load_checkpoint_in_model`` of an unsharded model; names in ``known`` are not unexpected
    (a pipeline stage: the other stages hold them)."""
    import torch

    # With weights going to disk, memory holds one file's bytes at a time (each is read twice: checked
    # first, then read again at its turn and required to be the same bytes); else every file is read once.
    disk = any(str(d) == "disk" for d in (device_map or {}).values()) if isinstance(device_map, Mapping) else False
    sources, aliases = checkpoint_sources(checkpoint, release=disk)
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
    unexpected = [k for k in shapes if k not in expected and k not in known]
    mismatched = [
        f"{k}: checkpoint {list(shapes[k])} vs model {list(expected[k].shape)}"
        for k in shapes
        if k in expected and shapes[k] is not None and isinstance(expected[k], torch.Tensor)
        and tuple(expected[k].shape) != shapes[k]
    ]
    problems = fit_problems(mismatched, missing, unexpected, strict)
    if problems:
        hint = "" if mismatched else "; pass strict=False to load the keys that match"
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(checkpoint)!r} does not fit {type(model).__name__} (model unchanged): "
            + "; ".join(problems) + hint
        )
    if device_map:
        from .utils.device_map import check_gpus_visible

        check_gpus_visible(device_map)
    for name in expected:
        _device_for(name, device_map)  # every tensor has a device before anything moves
    _check_ties(ties, device_map)
    log_partial_load(checkpoint, model, missing, unexpected)

    placer = _Placer(model, device_map, dtype, keep_in_fp32_modules or [], offload_folder, offload_buffers)
    aliases_of: dict[str, list[str]] = {}
    for alias, canonical in restored.items():
        if alias in expected:
            aliases_of.setdefault(canonical, []).append(alias)
    # Names tied in the model but absent from the file (transformers 5 leaves lm_head.weight out of a
    # tied checkpoint) take the tensor their twin loads, so they stay tied instead of staying on meta.
    for name in list(shapes):
        for twin in sorted(ties.get(name, ())):
            if twin != name and twin not in shapes and twin in expected:
                aliases_of.setdefault(name, [])
                if twin not in aliases_of[name]:
                    aliases_of[name].append(twin)
                shapes[twin] = shapes[name]  # loaded once: later twins of the group are not loaded again
    for source in sources:
        for name, value in _tensors(source, lambda n: n in expected or n in aliases_of):
            if name in expected:
                placer.put(name, value)
            for alias in aliases_of.get(name, ()):
                placer.put(alias, value)
        placer.flush()  # this shard's disk-bound weights go out before the next shard comes in
        source.release()
    return LoadResult(missing, unexpected)
