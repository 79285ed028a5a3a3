"""State dicts as tensors plus a JSON skeleton: checkpoints without pickle.

``encode`` walks a state (dicts, lists, tuples, numbers, strings, None, tensors, NumPy arrays and
scalars, dtypes, devices) and returns a JSON-able skeleton in which every tensor is replaced by a
reference to a name in the returned tensor dict. ``decode`` rebuilds the state. Anything else
(arbitrary objects) raises ``NotEncodable`` so the caller can fall back to ``torch.save``, which then
needs an explicit opt-in to load.

Skeleton conventions: JSON objects with string keys are dicts; JSON arrays are lists; a one-key
object whose key starts with ``"__hasten_"`` is a tagged value (tensor reference, tuple, dict with
non-string keys, NumPy array/scalar, dtype, device).
"""

from __future__ import annotations

import math
from typing import Any

import torch

_TAG = "__hasten_"


class NotEncodable(TypeError):
    """The state holds a value that only pickle could store."""


def encode(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors) for ``state``; tensor names are ``prefix`` + a running number."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, prefix, "state")
    return skeleton, tensors


def _tensor(value: torch.Tensor, tensors: dict, prefix: str) -> str:
    name = f"{prefix}{len(tensors)}"
    tensors[name] = value
    return name


def _encode(value: Any, tensors: dict, prefix: str, where: str) -> Any:
    numpy = _numpy(value)  # first: numpy.float64 is also a float
    if numpy is not None:
        return numpy(value, tensors, prefix, where)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {_TAG + "float": repr(value)}  # inf/nan: keep the JSON strict
    if isinstance(value, torch.Tensor):
        if value.is_sparse or value.layout != torch.strided:
            raise NotEncodable(f"{where} is a {value.layout} tensor; only dense tensors are stored")
        return {_TAG + "tensor": _tensor(value, tensors, prefix)}
    if isinstance(value, dict):
        items = [(k, _encode(v, tensors, prefix, f"{where}[{k!r}]")) for k, v in value.items()]
        if all(isinstance(k, str) and not k.startswith(_TAG) for k, _ in items) and not (
            len(items) == 1 and items[0][0].startswith(_TAG)
        ):
            return {k: v for k, v in items}
        return {_TAG + "dict": [[_encode(k, tensors, prefix, f"{where} key"), v] for k, v in items]}
    if isinstance(value, list):
        return [_encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {_TAG + "tuple": [_encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, torch.dtype):
        return {_TAG + "dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {_TAG + "device": str(value)}
    raise NotEncodable(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which needs pickle")


def _numpy(value: Any) -> Any:
    module = type(value).__module__
    if not module.startswith("numpy"):
        return None
    import numpy as np

    if isinstance(value, np.ndarray):
        def array(v: Any, tensors: dict, prefix: str, where: str) -> Any:
            if v.dtype == object:
                raise NotEncodable(f"{where} is a NumPy array of Python objects, which needs pickle")
            try:
                tensor = torch.from_numpy(np.ascontiguousarray(v))
            except TypeError:
                raise NotEncodable(f"{where} is a NumPy array of dtype {v.dtype}, which torch cannot hold") from None
            return {_TAG + "ndarray": _tensor(tensor, tensors, prefix)}
        return array
    if isinstance(value, np.generic):
        def scalar(v: Any, tensors: dict, prefix: str, where: str) -> Any:
            return {_TAG + "npscalar": [str(v.dtype), _encode(v.item(), tensors, prefix, where)]}
        return scalar
    return None


def decode(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state that ``encode`` turned into ``skeleton`` and ``tensors``."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if len(skeleton) == 1:
        (key, value), = skeleton.items()
        if key.startswith(_TAG):
            return _decode_tag(key[len(_TAG):], value, tensors)
    return {k: decode(v, tensors) for k, v in skeleton.items()}


def _decode_tag(tag: str, value: Any, tensors: dict) -> Any:
    if tag == "tensor":
        return tensors[value]
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in value)
    if tag == "dict":
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in value}
    if tag == "float":
        return float(value)
    if tag == "dtype":
        return getattr(torch, value)
    if tag == "device":
        return torch.device(value)
    if tag == "ndarray":
        return tensors[value].numpy()
    if tag == "npscalar":
        import numpy as np

        return np.dtype(value[0]).type(decode(value[1], tensors))
    raise ValueError(f"unknown value tag {tag!r} in a checkpoint skeleton (written by a newer hasten?)")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
