"""Snapshots of this process's random number generators (Python, NumPy, torch CPU and devices)."""

from __future__ import annotations

import random
from typing import Any

import torch


def _numpy():  # noqa: ANN202
    try:
        import numpy
    except ImportError:  # NumPy is optional
        return None
    return numpy


def _device_modules() -> list[tuple[str, Any]]:
    """Accelerator RNGs in use here: only initialised backends (saving must not start CUDA)."""
    out = []
    for name in ("cuda", "xpu"):
        module = getattr(torch, name, None)
        if module is None or not module.is_available():
            continue
        initialized = getattr(module, "is_initialized", lambda: True)()
        if initialized:
            out.append((name, module))
    return out


def capture() -> dict[str, Any]:
    """The current states (JSON skeleton + tensors via ``codec``)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    for name, module in _device_modules():
        state[name] = list(module.get_rng_state_all())
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        state["mps"] = mps.get_rng_state()
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Set the generators from ``capture``'s state; returns what could not be restored (and why)."""
    notes: list[str] = []
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"].to(torch.uint8))
    np = _numpy()
    if "numpy" in state:
        if np is None:
            notes.append("NumPy's RNG state was saved but NumPy is not installed here")
        else:
            s = state["numpy"]
            np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), int(s["pos"]), int(s["has_gauss"]),
                                 float(s["cached_gaussian"])))
    devices = dict(_device_modules())
    for name in ("cuda", "xpu"):
        if name not in state:
            continue
        module = devices.get(name) or getattr(torch, name, None)
        if module is None or not module.is_available():
            notes.append(f"{name.upper()} RNG states were saved but no {name.upper()} device is available here")
            continue
        saved = state[name]
        count = module.device_count()
        if len(saved) != count:
            notes.append(f"{len(saved)} {name.upper()} RNG states were saved for {count} devices here; "
                         "the first ones were restored")
        for index in range(min(len(saved), count)):
            module.set_rng_state(saved[index].to(torch.uint8), index)
    if "mps" in state and getattr(torch, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"].to(torch.uint8))
    return notes


def check(state: dict[str, Any]) -> None:
    """Raise (TypeError, ValueError, ...) unless ``restore`` can set every generator from ``state``: each one
    is tried on a scratch generator, so nothing of this process changes and ``restore`` cannot fail halfway."""
    random.Random().setstate(_as_tuple(state["python"]))
    if not isinstance(state["torch"], torch.Tensor):
        raise TypeError(f"the torch generator state is a {type(state['torch']).__name__}, not a tensor")
    torch.Generator().set_state(state["torch"].to(torch.uint8))
    np = _numpy()
    if "numpy" in state and np is not None:
        s = state["numpy"]
        np.random.RandomState().set_state((s["kind"], s["keys"].numpy().astype("uint32"), int(s["pos"]),
                                           int(s["has_gauss"]), float(s["cached_gaussian"])))
    for name in ("cuda", "xpu"):
        if name in state and not all(isinstance(t, torch.Tensor) for t in state[name]):
            raise TypeError(f"the {name} generator states are not tensors")


def _as_tuple(value: Any) -> Any:
    """``random.setstate`` needs tuples all the way down."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value
