"""Collectives and helpers on nested structures of tensors (``accelerate.utils.operations`` names).

Every function takes tensors nested in dicts (any ``Mapping``), lists and tuples (namedtuples
included) and returns the same structure. With one process the collectives return their input
without communicating. In debug mode (``HASTEN_DEBUG=1`` or ``ACCELERATE_DEBUG_MODE=1``) each
collective first exchanges, with one extra ``all_gather_object``, the operation's name and the
structure and shapes of every process's input, and raises ``DistributedOperationException`` when
they disagree, instead of hanging or silently returning garbage. Outside debug mode there is no
extra communication.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from .. import progress
from ..state import PartialState
from ..warning_kinds import HastenWarning

REDUCTIONS = ("sum", "mean", "max", "min", "none")
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_LIST_GATHER_BACKENDS: set[str] = set()  # backends that refused the single-tensor gather


class DistributedOperationException(RuntimeError):
    """The processes called a collective with inputs, or operations, that do not match."""


# -- walking nested structures --------------------------------------------------------------------
def is_torch_tensor(tensor: Any) -> bool:  # Accelerate's parameter name
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is an instance of a ``collections.namedtuple``/``typing.NamedTuple`` class."""
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


def honor_type(obj: Union[list, tuple], generator: Any) -> Union[list, tuple]:
    """Build a container of ``obj``'s type (list, tuple, namedtuple, subclasses) from the items of
    ``generator`` (Accelerate's parameter name)."""
    if is_namedtuple(obj):
        return type(obj)(*generator)  # namedtuples take their fields positionally
    return type(obj)(generator)


def _rebuild_mapping(data: Mapping, items: dict) -> Mapping:
    if isinstance(data, defaultdict):
        return type(data)(data.default_factory, items)
    try:
        return type(data)(items)
    except TypeError:  # a Mapping class that cannot be built from a dict: keep the values
        return items


def recursively_apply(func: Callable, data: Any, *args: Any, test_type: Callable[[Any], bool] = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs: Any) -> Any:
    """Apply ``func(leaf, *args, **kwargs)`` to every leaf of ``data`` for which ``test_type`` holds.

    Dicts (any ``Mapping``, its type kept), lists, tuples and namedtuples are walked; other leaves
    are returned unchanged, or rejected with ``TypeError`` when ``error_on_other_type`` is set.
    """
    if isinstance(data, (tuple, list)):
        return honor_type(data, [recursively_apply(func, item, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs) for item in data])
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {key: recursively_apply(func, value, *args, test_type=test_type,
                                                              error_on_other_type=error_on_other_type, **kwargs)
                                       for key, value in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        # Accelerate's text, which code written for it compares exactly; it names the type and what is accepted.
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', test_type)}` should be "
            "passed."
        )
    return data


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _tensor_leaves(data: Any, op: str, hint: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every leaf in walking order; a non-tensor leaf is a ``TypeError``."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def visit(item: Any, path: str) -> None:
        if isinstance(item, (tuple, list)):
            for i, value in enumerate(item):
                visit(value, f"{path}[{i}]")
        elif isinstance(item, Mapping):
            for key, value in item.items():
                visit(value, f"{path}[{key!r}]")
        elif isinstance(item, torch.Tensor):
            leaves.append((path, item))
        else:
            raise TypeError(
                f"{op} got a {_type_name(item)} at {path}: it accepts torch.Tensor values nested in dicts, "
                f"lists and tuples{hint}"
            )

    visit(data, "input")
    return leaves


def _checked_leaves(state: PartialState, data: Any, op: str, hint: str = "") -> list[torch.Tensor]:
    leaves = _tensor_leaves(data, op, hint)
    if state.backend == "nccl":
        for path, tensor in leaves:
            if tensor.device.type != "cuda":
                raise ValueError(
                    f"{op} got a tensor on {tensor.device} at {path}, but the NCCL process group only moves CUDA "
                    f"tensors; move it first, e.g. tensor.to(accelerator.device)"
                )
    return [tensor for _, tensor in leaves]


def _comm_device(state: PartialState) -> torch.device:
    return torch.device("cpu") if state.backend == "gloo" else state.device


# -- debug mode: every process checks that the others called the same thing ------------------------
_FIXES = {
    "gather": "Every process must pass tensors of the same structure, shape and dtype. Pad them along dim 0 "
              "first with pad_across_processes, or use gather_object for data whose shape varies.",
    "reduce": "Every process must reduce tensors of the same structure, shape and dtype, with the same "
              "reduction.",
    "broadcast": "Every process must pass tensors of the source process's structure, shape and dtype (on the "
                 "receiving processes, e.g. torch.empty of that shape) and the same from_process.",
    "pad_across_processes": "Every process must pass the same structure of tensors, with the same dtype, number "
                            "of dimensions and sizes outside the padded dim, and the same dim.",
    "broadcast_object_list": "Every process must pass a list of the same length and the same from_process.",
}


def _describe(data: Any, mask_dim: Optional[int] = None) -> Any:
    """A picklable outline of ``data``: containers kept, tensors as 'dtype[shape]' strings."""
    if isinstance(data, (tuple, list)):
        items = [_describe(item, mask_dim) for item in data]
        return tuple(items) if isinstance(data, tuple) else items
    if isinstance(data, Mapping):
        return {key: _describe(value, mask_dim) for key, value in data.items()}
    if isinstance(data, torch.Tensor):
        dtype = str(data.dtype).replace("torch.", "")
        if getattr(data, "is_nested", False):
            return f"nested {dtype} on {data.device.type}"
        shape: list[Any] = list(data.shape)
        if mask_dim is not None:  # pad_across_processes: sizes along its dim may differ
            if -len(shape) <= mask_dim < len(shape):
                shape[mask_dim] = "*"
            else:  # a tensor without that dim is left alone: only its number of dims matters
                shape = ["*"] * len(shape)
        return f"{dtype}[{', '.join(map(str, shape))}] on {data.device.type}"
    return f"<{_type_name(data)}>"


def _format(outline: Any) -> str:
    if isinstance(outline, dict):
        return "{" + ", ".join(f"{key!r}: {_format(value)}" for key, value in outline.items()) + "}"
    if isinstance(outline, list):
        return "[" + ", ".join(map(_format, outline)) + "]"
    if isinstance(outline, tuple):
        return "(" + ", ".join(map(_format, outline)) + ("," if len(outline) == 1 else "") + ")"
    return str(outline)


def _call_text(entry: Any) -> str:
    if not (isinstance(entry, dict) and "hasten_op" in entry):
        return f"not a hasten collective (it sent {entry!r:.200})"
    parts = [] if entry["shapes"] is None else [_format(entry["shapes"])]
    parts += [f"{key}={value!r}" for key, value in entry["args"].items()]
    text = f"{entry['hasten_op']}({', '.join(parts)})"
    return text if len(text) <= 2000 else text[:2000] + "..."


def _verify(state: PartialState, op: str, *data: Any, mask_dim: Optional[int] = None, **args: Any) -> None:
    """Debug mode only: raise on every process if the processes' calls do not match."""
    if not (state.debug and state.use_distributed):
        return
    mine = {
        "hasten_op": op,
        "args": args,
        "shapes": _describe(data[0]) if data else None,
        "key": _describe(data[0], mask_dim) if data else None,
    }
    everyone: list[Any] = [None] * state.num_processes
    dist.all_gather_object(everyone, mine)
    ops = [entry.get("hasten_op") if isinstance(entry, dict) else None for entry in everyone]
    calls = "\n".join(f"  - process {rank}: {_call_text(entry)}" for rank, entry in enumerate(everyone))
    if len(set(ops)) > 1:
        raise DistributedOperationException(
            f"{op}: the processes called different collective operations at the same point (debug mode):\n{calls}\n"
            "Every process must call the same collectives in the same order; look for one called inside "
            "`if accelerator.is_main_process:` or in a loop that runs a different number of times per process."
        )
    if any((entry["args"], entry["key"]) != (args, mine["key"]) for entry in everyone):
        raise DistributedOperationException(
            f"{op}: the inputs do not match across processes, so the operation would fail or hang (debug mode):\n"
            f"{calls}\n{_FIXES[op]}"
        )


# -- collectives ----------------------------------------------------------------------------------
def _all_gather_into(out: torch.Tensor, tensor: torch.Tensor, state: PartialState) -> None:
    """Gather equal-shaped ``tensor`` from every process into ``out`` (rank-major along dim 0)."""
    if state.backend not in _LIST_GATHER_BACKENDS:
        try:
            _ALL_GATHER_SINGLE(out, tensor)
            return
        except RuntimeError as err:  # older gloo: "no support for _allgather_base"; raised before any traffic
            if "support" not in str(err).lower():
                raise
            _LIST_GATHER_BACKENDS.add(state.backend)
    rows = tensor.shape[0]
    dist.all_gather([out[i * rows:(i + 1) * rows] for i in range(state.num_processes)], tensor)


def _gather_one(tensor: torch.Tensor, state: PartialState) -> torch.Tensor:
    # The result is not differentiable (as in Accelerate); a tensor that requires grad must not
    # take autograd into the collective, which writes into views of the output.
    tensor = tensor.detach()
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    tensor = tensor.contiguous()
    out = tensor.new_empty((state.num_processes * tensor.shape[0], *tensor.shape[1:]))
    _all_gather_into(out, tensor, state)
    return out


@progress.collective("gather")
def gather(tensor: Any) -> Any:
    """Concatenate (nested) tensors from every process along dim 0, in rank order.

    Every process gets the result. 0-dim tensors become 1-d first (one value per process). The
    tensors must have the same shape and dtype on every process (``pad_across_processes`` first if
    they differ along dim 0). With one process the input is returned as is.
    """
    state = PartialState()
    if not state.use_distributed:
        return tensor
    _verify(state, "gather", tensor)
    _checked_leaves(state, tensor, "gather", "; use gather_object for other picklable objects")
    return recursively_apply(_gather_one, tensor, state)


@progress.collective("gather_object")
def gather_object(object: Any) -> list:  # noqa: A002 - Accelerate's argument name
    """Gather picklable objects from every process: each process's list, concatenated in rank order.

    A list or tuple contributes its items; any other object contributes itself as one item. With one
    process the input is returned as is.
    """
    state = PartialState()
    if not state.use_distributed:
        return object
    _verify(state, "gather_object")
    everyone: list[Any] = [None] * state.num_processes
    dist.all_gather_object(everyone, object)
    out: list[Any] = []
    for item in everyone:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)
    return out


def _check_source(from_process: Any, state: PartialState, op: str) -> None:
    if not isinstance(from_process, int) or not 0 <= from_process < state.num_processes:
        raise ValueError(
            f"{op}: from_process={from_process!r} is not a process index; pass one of 0..{state.num_processes - 1}"
        )


def _broadcast_one(tensor: torch.Tensor, from_process: int) -> torch.Tensor:
    if tensor.is_contiguous():
        dist.broadcast(tensor, src=from_process)
    else:  # the collective needs dense memory: go through a contiguous copy, then write back in place
        buffer = tensor.detach().contiguous()
        dist.broadcast(buffer, src=from_process)
        with torch.no_grad():  # also for a leaf that requires grad, which dist.broadcast itself accepts
            tensor.copy_(buffer)
    return tensor


@progress.collective("broadcast")
def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Overwrite (nested) tensors in place with process ``from_process``'s values; returns them."""
    state = PartialState()
    if not state.use_distributed:
        return tensor
    _verify(state, "broadcast", tensor, from_process=from_process)
    _check_source(from_process, state, "broadcast")
    _checked_leaves(state, tensor, "broadcast", "; use broadcast_object_list for other picklable objects")
    return recursively_apply(_broadcast_one, tensor, from_process)


@progress.collective("copy_tensor_to_devices")
def copy_tensor_to_devices(tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Send a tensor that exists on one process only to every process; the others pass ``None``.

    Unlike ``broadcast``, the receiving processes need not know the shape or dtype: the owner is
    found, then its tensor is broadcast. Every process returns a copy on its own device. Exactly
    one process must pass a tensor. With one process the tensor is returned as is.
    """
    state = PartialState()
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"copy_tensor_to_devices takes a tensor or None, got {_type_name(tensor)}")
    if not state.use_distributed:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices got None on the only process; pass the tensor to copy")
        return tensor
    _verify(state, "copy_tensor_to_devices")
    everyone: list[Any] = [None] * state.num_processes
    dist.all_gather_object(everyone, None if tensor is None else (tuple(tensor.shape), tensor.dtype))
    owners = [rank for rank, meta in enumerate(everyone) if meta is not None]
    if len(owners) != 1:
        found = f"processes {owners} each passed one" if owners else "every process passed None"
        raise ValueError(
            f"copy_tensor_to_devices needs a tensor on exactly one process, but {found}; pass None on the others "
            "(or use broadcast when every process already holds a tensor of the right shape)"
        )
    shape, dtype = everyone[owners[0]]
    device = _comm_device(state)
    if tensor is None:
        buffer = torch.empty(shape, dtype=dtype, device=device)
    else:  # a fresh dense copy: the caller's tensor (maybe a leaf that requires grad) is not written to
        buffer = tensor.detach().to(device, copy=True).contiguous()
    dist.broadcast(buffer, src=owners[0])
    return buffer.to(state.device)


@progress.collective("broadcast_object_list")
def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Replace, in place, the items of ``object_list`` with process ``from_process``'s; returns the list."""
    state = PartialState()
    if not state.use_distributed:
        return object_list
    length = len(object_list) if hasattr(object_list, "__len__") else None
    _verify(state, "broadcast_object_list", from_process=from_process, length=length)
    _check_source(from_process, state, "broadcast_object_list")
    if not isinstance(object_list, list):
        raise TypeError(
            f"broadcast_object_list needs a list to fill in place, got a {_type_name(object_list)}; "
            f"wrap the objects in a list, e.g. [obj]"
        )
    dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def _reduce_one(tensor: torch.Tensor, reduction: str, scale: float, state: PartialState) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    if reduction != "none" and state.use_distributed:
        dist.all_reduce(out, op=_REDUCE_OPS[reduction])
    if reduction == "mean":
        if out.is_floating_point() or out.is_complex():
            out = out.div_(state.num_processes) if state.num_processes > 1 else out
        else:  # a true mean is fractional: integer tensors give floats, whatever the number of processes
            out = out / state.num_processes
    if scale != 1.0:
        out = out.mul_(scale) if out.is_floating_point() or out.is_complex() else out * scale
    return out


@progress.collective("reduce")
def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce (nested) tensors over every process; every process gets the result (new tensors).

    Args:
        tensor: tensors nested in dicts, lists and tuples, same shapes on every process.
        reduction: "mean" (the default, as in ``accelerate.utils.reduce``; ``Accelerator.reduce``
            defaults to "sum"), "sum", "max", "min", or "none" (no communication: a copy of this
            process's values). The mean of integer tensors is a floating-point tensor.
        scale: multiplies the result. Unlike Accelerate (XLA only) it applies on every backend.
    """
    state = PartialState()
    _verify(state, "reduce", tensor, reduction=reduction)
    key = reduction.lower() if isinstance(reduction, str) else reduction
    if key not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; choose one of {list(REDUCTIONS)}")
    _checked_leaves(state, tensor, "reduce")
    return recursively_apply(_reduce_one, tensor, key, scale, state)


class CannotPadNestedTensorWarning(HastenWarning):
    """``pad_across_processes`` met a nested (jagged) tensor, which it leaves as is."""


def _pad_size(tensor: torch.Tensor, dim: int) -> int:
    """The size along ``dim`` to pad, or -1 for a tensor left alone (nested, or without that dim)."""
    if getattr(tensor, "is_nested", False) or not -tensor.ndim <= dim < tensor.ndim:
        return -1
    return tensor.shape[dim]


def _pad_one(tensor: torch.Tensor, targets: Iterator[int], dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    target = next(targets)
    size = _pad_size(tensor, dim)
    if size < 0 or size >= target:
        return tensor
    dim = dim % tensor.ndim
    new_shape = list(tensor.shape)
    new_shape[dim] = target
    out = tensor.new_full(new_shape, pad_index)
    start = target - size if pad_first else 0
    out.narrow(dim, start, size).copy_(tensor)
    return out


@progress.collective("pad_across_processes")
def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad (nested) tensors along ``dim`` to the largest size over processes, so they can be gathered.

    Args:
        dim: the dimension to pad; a tensor without that dimension is left unchanged (as in Accelerate).
        pad_index: the fill value.
        pad_first: pad at the start instead of the end (e.g. left-padded generations).

    One collective exchanges the sizes of all the tensors of the structure at once.
    """
    state = PartialState()
    if not state.use_distributed:
        _warn_if_nested(tensor)  # one process too: the script will meet it with several
        return tensor
    _verify(state, "pad_across_processes", tensor, mask_dim=dim, dim=dim)
    leaves = _checked_leaves(state, tensor, "pad_across_processes")
    if not leaves:
        return tensor
    _warn_if_nested(leaves)
    sizes = torch.tensor([_pad_size(t, dim) for t in leaves], dtype=torch.int64, device=_comm_device(state))
    everyone = sizes.new_empty(state.num_processes * len(leaves))
    _all_gather_into(everyone, sizes, state)
    targets = iter(everyone.view(state.num_processes, len(leaves)).amax(dim=0).tolist())
    return recursively_apply(_pad_one, tensor, targets, dim, pad_index, pad_first)


def _warn_if_nested(data: Any) -> None:
    """Warn (CannotPadNestedTensorWarning) when ``data`` holds nested tensors, which are not padded."""
    if _holds_nested(data):
        warnings.warn("pad_across_processes cannot pad nested tensors; they are returned unchanged",
                      CannotPadNestedTensorWarning, stacklevel=3)


def _holds_nested(data: Any) -> bool:
    if isinstance(data, Mapping):
        return any(_holds_nested(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_holds_nested(v) for v in data)
    return getattr(data, "is_nested", False) is True


# -- local helpers --------------------------------------------------------------------------------
def send_to_device(tensor: Any, device: Union[str, int, torch.device], non_blocking: bool = False,
                   skip_keys: Optional[Union[str, list[str]]] = None) -> Any:
    """Move (nested) tensors, and any object with a ``.to`` method, to ``device``.

    Other values pass through. ``skip_keys`` names dict keys whose values stay where they are.
    """
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    if isinstance(tensor, torch.Tensor):
        return tensor.to(device, non_blocking=non_blocking)
    if isinstance(tensor, Mapping) and skip_keys:
        return _rebuild_mapping(tensor, {
            key: value if key in skip_keys else send_to_device(value, device, non_blocking, skip_keys)
            for key, value in tensor.items()})
    if callable(getattr(tensor, "to", None)) and not isinstance(tensor, type):
        # e.g. transformers' BatchEncoding; some .to methods take no non_blocking
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:
            return tensor.to(device)
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, [send_to_device(t, device, non_blocking, skip_keys) for t in tensor])
    if isinstance(tensor, Mapping):
        return _rebuild_mapping(tensor, {key: send_to_device(value, device, non_blocking, skip_keys)
                                         for key, value in tensor.items()})
    return tensor


def find_device(data: Any) -> Optional[torch.device]:
    """The device of the first tensor found in ``data``, or None."""
    if isinstance(data, torch.Tensor):
        return data.device
    values = data.values() if isinstance(data, Mapping) else data if isinstance(data, (tuple, list)) else ()
    for value in values:
        device = find_device(value)
        if device is not None:
            return device
    return None


def find_batch_size(data: Any) -> int:
    """The size along dim 0 of the first tensor in ``data`` (first item of lists, first dict value)."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"cannot find the batch size of an empty {_type_name(data)}; pass a batch with tensors")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"find_batch_size needs tensors (nested in dicts, lists, tuples), got a {_type_name(data)}")
    if data.ndim == 0:
        raise ValueError("find_batch_size got a 0-dim tensor, which has no batch dimension")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> Optional[int]:
    """``find_batch_size``, or None where it cannot tell."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def concatenate(data: list, dim: int = 0) -> Any:
    """Concatenate a list of same-structured (nested) batches along ``dim`` into one batch."""
    if not isinstance(data, (tuple, list)) or len(data) == 0:
        raise ValueError(f"concatenate needs a non-empty list of batches, got {_type_name(data)} {data!r:.80}")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, [concatenate([d[i] for d in data], dim=dim) for i in range(len(first))])
    if isinstance(first, Mapping):
        return _rebuild_mapping(first, {key: concatenate([d[key] for d in data], dim=dim) for key in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(f"concatenate can only join tensors (nested in dicts, lists, tuples), got {_type_name(first)}")


def slice_tensors(data: Any, tensor_slice: Any, process_index: Optional[int] = None,
                  num_processes: Optional[int] = None) -> Any:
    """``tensor[tensor_slice]`` for every tensor of ``data``."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def listify(data: Any) -> Any:
    """Tensors of ``data`` as (nested) Python lists of numbers."""
    def to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).tolist()

    return recursively_apply(to_list, data)


def _is_half_float(data: Any) -> bool:
    if isinstance(data, torch.Tensor):  # the common case, and the one torch.compile can trace
        return data.dtype in (torch.float16, torch.bfloat16)
    return getattr(data, "dtype", None) in (torch.float16, torch.bfloat16) and callable(getattr(data, "float", None))


def convert_to_fp32(tensor: Any) -> Any:
    """Turn fp16/bf16 tensors of (nested) ``tensor`` into fp32; everything else is unchanged."""
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half_float)


class ConvertOutputsToFp32:
    """Wrap a forward function so that its fp16/bf16 outputs come back as fp32.

    A class rather than a closure so that a model whose ``forward`` was replaced by it can still be
    pickled (``torch.save(model)``, multiprocessing); ``__wrapped__`` leads back to the original.
    """

    def __init__(self, model_forward: Callable) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Assigned on a class, behave like a function: bind to the instance.
        return self if obj is None else functools.partial(self, obj)


def convert_outputs_to_fp32(model_forward: Callable) -> ConvertOutputsToFp32:
    """Wrap ``model_forward`` so that its fp16/bf16 floating-point outputs are returned as fp32."""
    return ConvertOutputsToFp32(model_forward)


# Accelerate has these names in this module; hasten keeps them elsewhere (see accelerate_paths).
from .accelerate_paths import names_from_utils  # noqa: E402 - after the module's own names

__getattr__ = names_from_utils(__name__, (
    "is_tensor_information", "get_data_structure", "initialize_tensors", "pad_input_tensors",
    "GatheredParameters",
))
