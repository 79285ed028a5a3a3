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
    if name == "HfDeepSpeedConfig":  # transformers' class, as Accelerate re-exports it
        from transformers.integrations import HfDeepSpeedConfig

        return HfDeepSpeedConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
