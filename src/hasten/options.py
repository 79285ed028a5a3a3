"""Turning ``Accelerator(...)`` arguments (and ``HASTEN_*`` variables) into validated settings.

Kept apart from the facade so that every argument check, with its error message, is in one place.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

from .utils.dataclasses import (
    KWARGS_HANDLERS,
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    TorchDynamoPlugin,
)
from .utils.environment import parse_int

_LEGACY_DATA_KWARGS = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")
# Default of Accelerator(split_batches=...): tells "not given" from an explicit False.
UNSET: Any = object()


def dynamo_from_env() -> Optional[TorchDynamoPlugin]:
    plugin = TorchDynamoPlugin()  # unset fields come from HASTEN_DYNAMO_* / ACCELERATE_DYNAMO_*
    return None if plugin.backend == "no" else plugin


def unsupported_parallelism(**plugins: Any) -> None:
    """Tensor, Megatron-LM and N-D parallelism are not implemented: refuse them instead of ignoring them."""
    for name, value in plugins.items():
        if value is not None:
            raise NotImplementedError(
                f"Accelerator({name}=...) is not supported by hasten yet; remove it (data parallelism, FSDP and "
                "DeepSpeed are the supported strategies)"
            )


def collect_handlers(kwargs_handlers: Optional[Sequence[Any]]) -> dict[type, Any]:
    found: dict[type, Any] = {}
    for handler in kwargs_handlers or ():
        kind = next((k for k in KWARGS_HANDLERS if isinstance(handler, k)), None)
        if kind is None:
            names = ", ".join(k.__name__ for k in KWARGS_HANDLERS)
            raise TypeError(f"kwargs_handlers got {handler!r}, which is not one of {names}")
        if kind in found:
            raise ValueError(f"kwargs_handlers holds two {kind.__name__} objects; pass one and merge the settings")
        found[kind] = handler
    return found

def merge_legacy_data_kwargs(config: Optional[DataLoaderConfiguration], legacy: dict[str, Any]) -> DataLoaderConfiguration:
    unknown = set(legacy) - set(_LEGACY_DATA_KWARGS)
    if unknown:
        raise TypeError(f"Accelerator() got unexpected keyword argument(s) {sorted(unknown)}")
    config = config or DataLoaderConfiguration()
    for key, value in legacy.items():
        warnings.warn(f"Accelerator({key}=...) is deprecated; pass dataloader_config=DataLoaderConfiguration({key}=...)",
                      FutureWarning, stacklevel=3)
        setattr(config, key, value)
    return config

def accumulation_plugin(steps: Any, plugin: Optional[GradientAccumulationPlugin]) -> GradientAccumulationPlugin:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps={steps!r} is invalid; use a whole number >= 1 (1 = no accumulation)"
        )
    if plugin is not None:
        if steps != 1:
            raise ValueError(
                "both gradient_accumulation_steps and gradient_accumulation_plugin were given; "
                "set num_steps in the plugin only"
            )
        if plugin.num_steps is None or plugin.num_steps < 1:
            raise ValueError(f"GradientAccumulationPlugin(num_steps={plugin.num_steps!r}) needs a whole number >= 1")
        return plugin
    if steps == 1:
        steps = parse_int("GRADIENT_ACCUMULATION_STEPS", 1)
        if steps < 1:
            raise ValueError(f"HASTEN_GRADIENT_ACCUMULATION_STEPS={steps} is invalid; use a whole number >= 1")
    return GradientAccumulationPlugin(num_steps=steps)
