"""Accelerate's DeepSpeed helpers that scripts call directly (the engine wrappers are ``prepare``'s business)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .imports import is_deepspeed_available


def get_active_deepspeed_plugin(state: Any) -> Any:
    """The ``DeepSpeedPlugin`` the given ``AcceleratorState`` runs with; a ValueError when it runs without DeepSpeed."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError("get_active_deepspeed_plugin: this AcceleratorState runs without DeepSpeed; create the "
                         "Accelerator with deepspeed_plugin=DeepSpeedPlugin(...)")
    return plugin


def named_plugins(state: Any, name: Any) -> dict[str, Any]:
    """The state's named plugins (``deepspeed_plugins={...}``); a ValueError naming the fix when the run has
    none or none is named ``name``."""
    from .dataclasses import DistributedType

    plugins = getattr(state, "deepspeed_plugins", None) if state.distributed_type == DistributedType.DEEPSPEED else None
    if not plugins:
        raise ValueError("this AcceleratorState runs without named DeepSpeed plugins; create the Accelerator with "
                         "deepspeed_plugins={'name': DeepSpeedPlugin(...), ...} to select plugins by name")
    if name not in plugins:
        raise ValueError(f"no DeepSpeed plugin is named {name!r}; the Accelerator was given "
                         f"{', '.join(repr(k) for k in plugins)}")
    return plugins


def select_plugin(state: Any, name: Any) -> Any:
    """Mark the plugin named ``name`` selected and the others not; returns it (the state makes it its
    ``deepspeed_plugin``: the config the next models ``prepare`` builds use, e.g. ZeRO-3 for a frozen teacher)."""
    plugins = named_plugins(state, name)
    for key, plugin in plugins.items():
        if key != name:
            plugin._unselect()
    plugins[name].select(_from_accelerator_state=True)
    return plugins[name]


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: Any = None, fwd_module: Any = None,  # noqa: N802 - Accelerate's name
                       enabled: bool = True) -> Iterator[None]:
    """Inside the block, ZeRO-3-partitioned ``params`` are whole on every process (DeepSpeed's
    ``GatheredParameters``); parameters that ZeRO-3 did not partition need nothing, so it does nothing."""
    import torch

    if isinstance(params, torch.Tensor):
        items = [params]
    else:
        params = items = list(params)  # a generator (model.parameters()) is read once, here
    if not (is_deepspeed_available() and any(hasattr(p, "ds_id") for p in items)):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled):
        yield


def __getattr__(name: str) -> Any:
    if name == "HfDeepSpeedConfig":  # the base class that transformers' own subclasses
        from .ds_config import HfDeepSpeedConfig

        return HfDeepSpeedConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
