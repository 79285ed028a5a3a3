"""Turning ``Accelerator(...)`` arguments (and ``HASTEN_*`` variables) into validated settings.

Kept apart from the facade so that every argument check, with its error message, is in one place.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

from .utils.dataclasses import (
    ActivationCheckpointingKwargs,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from .utils.environment import parse_flag, parse_int
from .utils.fp8_recipes import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs

# Kwargs handlers that the Accelerator accepts, by class.
KWARGS_HANDLERS: tuple[type, ...] = (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    AutocastKwargs,
    AORecipeKwargs,
    FP8RecipeKwargs,  # before its base classes, so that it is recognised as itself
    TERecipeKwargs,
    MSAMPRecipeKwargs,
    ProfileKwargs,
    ActivationCheckpointingKwargs,
)

_LEGACY_DATA_KWARGS = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")
# Default of Accelerator(split_batches=...): tells "not given" from an explicit False.
UNSET: Any = object()


def dynamo_from_env() -> Optional[TorchDynamoPlugin]:
    plugin = TorchDynamoPlugin()  # unset fields come from HASTEN_DYNAMO_* / ACCELERATE_DYNAMO_*
    return None if plugin.backend == "no" else plugin


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

def check_parallelism(config: Any, cpu: bool, sharded: bool, deepspeed: bool = False) -> Any:
    """The ``ParallelismConfig`` to use (given, else from the environment), checked against the job's size
    before the process group exists, so that a wrong layout fails on every process with the same message."""
    from .utils.parallelism_config import ParallelismConfig, parallelism_config_from_env

    if config is None:
        config = parallelism_config_from_env()
    if config is None:
        return None
    if not isinstance(config, ParallelismConfig):
        raise TypeError(f"parallelism_config must be a hasten.utils.ParallelismConfig, got {type(config).__name__}")
    from .device_choice import pick_device
    from .state import PartialState
    from .topology import detect_topology

    partial = PartialState._shared_state
    if "device" in partial:  # the state came first (e.g. PartialState() at the top of the script)
        world, device = partial["topology"].world_size, partial["device"].type
    else:
        topology = detect_topology()
        world, device = topology.world_size, pick_device(topology, cpu or parse_flag("USE_CPU")).type
    config.check(world, sharded, device, deepspeed=deepspeed)
    return config


def deepspeed_plugin_from(plugin: Any) -> Any:
    """The ``DeepSpeedPlugin`` to use: the one given, or one read from the environment."""
    from .utils.deepspeed_plugin import DeepSpeedPlugin

    if isinstance(plugin, str) and plugin == "from-environment":
        return DeepSpeedPlugin()
    if not isinstance(plugin, DeepSpeedPlugin):
        raise TypeError(f"deepspeed_plugin={type(plugin).__name__}; pass a hasten.utils.DeepSpeedPlugin, or "
                        "deepspeed_plugins={'name': DeepSpeedPlugin(...), ...}")
    return plugin


def named_deepspeed_plugins(plugins: Any) -> Optional[dict[str, Any]]:
    """Accelerate's ``deepspeed_plugins={"student": p1, "teacher": p2}`` checked (None when one plugin
    was given); the first one starts as the active plugin."""
    if not isinstance(plugins, dict):
        return None
    if not plugins:
        raise ValueError("deepspeed_plugins={} names no plugin; give at least one DeepSpeedPlugin")
    for name, plugin in plugins.items():
        if not isinstance(name, str):
            raise TypeError(f"deepspeed_plugins: the name {name!r} is not a string; name each plugin with a string")
        try:
            deepspeed_plugin_from(plugin)
        except TypeError:
            raise TypeError(f"deepspeed_plugins[{name!r}]={type(plugin).__name__}; each value must be a "
                            "hasten.utils.DeepSpeedPlugin") from None
    return dict(plugins)
