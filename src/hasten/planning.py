"""The run's plan: every decision the configuration implies, made once, in one place.

``make_plan`` turns what an ``Accelerator`` is given (its arguments, plugins, kwargs handlers, the
``HASTEN_*``/``ACCELERATE_*`` variables ``hasten launch`` sets) into a ``Plan``: the process state,
the distributed type, which strategy runs the job and with which layout, precision, fp8, compile
and gradient accumulation. The facade calls it once in ``Accelerator.__init__``; the strategy is
built from the plan (``hasten.strategies.build_strategy``) and everything else reads it. The
distributed type comes from ``hasten.strategy_rules.distributed_type_for``, the rule the process
state applies too when a user builds ``AcceleratorState`` directly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from . import progress
from .fp8 import plan_for as fp8_plan
from .options import (
    UNSET,
    accumulation_plugin,
    check_parallelism,
    collect_handlers,
    deepspeed_plugin_from,
    named_deepspeed_plugins,
    dynamo_from_env,
    merge_legacy_data_kwargs,
)
from .state import AcceleratorState, GradientState
from .strategy_rules import strategy_for
from .utils.dataclasses import (
    ActivationCheckpointingKwargs,
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)
from .utils.environment import parse_flag
from .utils.megatron_lm import parallelism_from_megatron
from .utils.parallelism_config import ParallelismConfig


@dataclass
class Plan:
    """What the run does, decided from its configuration (see ``make_plan``).

    Attributes:
        state / gradient_state: the process state the plan was made for (device, ranks, group).
        distributed_type: the run's ``DistributedType`` (the state's).
        strategy: the name of the strategy that runs it (a rule of ``hasten.strategy_rules``).
        mixed_precision: "no", "fp16", "bf16" or "fp8".
        parallelism_config: the N-D layout (``ParallelismConfig``), or None for the strategy's default.
        fsdp_plugin / deepspeed_plugin: the engine settings (None when that engine is not used).
        fp8: the float8 conversion plan (``hasten.fp8.Float8Plan``), or None.
        dynamo_plugin: how prepared models are compiled, or None.
        gradient_accumulation_steps: micro-steps per optimizer step, agreed with a DeepSpeed config.
        handlers: the kwargs handlers by class (``GradScalerKwargs``, ``DistributedDataParallelKwargs``, ...).
        dataloader_config: how prepared dataloaders shard data.
        activation_checkpointing: the ``ActivationCheckpointingKwargs`` the strategy applies to each
            trained model's blocks at ``prepare`` (from the handler, or from the FSDP plugin's
            ``activation_checkpointing`` flag), or None.
    """

    state: AcceleratorState
    gradient_state: GradientState
    distributed_type: DistributedType
    strategy: str
    mixed_precision: str
    parallelism_config: Optional[Any] = None
    fsdp_plugin: Any = None
    deepspeed_plugin: Any = None
    fp8: Any = None
    dynamo_plugin: Optional[TorchDynamoPlugin] = None
    gradient_accumulation_steps: int = 1
    handlers: dict[type, Any] = field(default_factory=dict)
    dataloader_config: DataLoaderConfiguration = field(default_factory=DataLoaderConfiguration)
    activation_checkpointing: Optional[ActivationCheckpointingKwargs] = None

    def handler(self, kind: type) -> Any:
        """The kwargs handler of class ``kind`` the user passed, or None."""
        return self.handlers.get(kind)


def make_plan(
    mixed_precision: Optional[str] = None,
    cpu: bool = False,
    gradient_accumulation_steps: int = 1,
    gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None,
    deepspeed_plugin: Any = None,
    fsdp_plugin: Any = None,
    torch_tp_plugin: Any = None,
    megatron_lm_plugin: Any = None,
    parallelism_config: Any = None,
    dynamo_backend: Optional[str] = None,
    dynamo_plugin: Optional[TorchDynamoPlugin] = None,
    kwargs_handlers: Optional[Sequence[Any]] = None,
    dataloader_config: Optional[DataLoaderConfiguration] = None,
    split_batches: Any = UNSET,
    deepspeed_plugins: Any = None,
    legacy: Optional[dict[str, Any]] = None,
) -> Plan:
    """The plan for an ``Accelerator`` given these arguments (same names and meaning as its own).

    Checks every argument first (the errors name the wrong value and the fix), then creates the
    process state (and the process group, once per process), then decides the rest from it.
    """
    parallelism_config = parallelism_from_megatron(megatron_lm_plugin, parallelism_config)  # before any group
    parallelism_config = parallelism_from_tp_plugin(torch_tp_plugin, parallelism_config)
    legacy = dict(legacy or {})
    if split_batches is not UNSET:
        legacy["split_batches"] = split_batches
    if deepspeed_plugins is not None:
        if deepspeed_plugin is not None:
            raise ValueError("pass deepspeed_plugin or deepspeed_plugins, not both")
        deepspeed_plugin = deepspeed_plugins
    named_plugins = named_deepspeed_plugins(deepspeed_plugin)  # checked before any process group exists
    if named_plugins is not None:
        deepspeed_plugin = next(iter(named_plugins.values()))  # the first is active until another is selected
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise ValueError("pass dynamo_backend or dynamo_plugin, not both (set the backend in the plugin)")
    handlers = collect_handlers(kwargs_handlers)
    dataloader_config = merge_legacy_data_kwargs(dataloader_config, legacy)
    accumulation = accumulation_plugin(gradient_accumulation_steps, gradient_accumulation_plugin)
    dynamo_plugin = _dynamo(dynamo_backend, dynamo_plugin)
    if fsdp_plugin is None and parse_flag("USE_FSDP"):
        fsdp_plugin = "from-environment"  # FSDP_* variables, resolved once the state is known
    if deepspeed_plugin is None and parse_flag("USE_DEEPSPEED"):
        deepspeed_plugin = "from-environment"

    pg_handler = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
    if pg_handler.hang_timeout is not None:
        progress.set_hang_timeout(pg_handler.hang_timeout)
    parallelism_config = check_parallelism(parallelism_config, cpu, sharded=fsdp_plugin is not None,
                                           deepspeed=deepspeed_plugin is not None)
    state = AcceleratorState(mixed_precision, cpu, dynamo_plugin=dynamo_plugin, deepspeed_plugin=deepspeed_plugin,
                             fsdp_plugin=fsdp_plugin, _from_accelerator=True, **pg_handler.to_kwargs())
    try:
        return _plan_after_state(state, accumulation, handlers, fsdp_plugin, deepspeed_plugin, named_plugins,
                                 parallelism_config, dynamo_plugin, gradient_accumulation_steps,
                                 gradient_accumulation_plugin, dataloader_config)
    except BaseException:
        # A configuration refused after the state opened its own one-process group (FSDP on one
        # process) must not leave that group behind for the next Accelerator of this interpreter.
        if getattr(state, "owns_group", False):
            state.destroy_process_group()
        raise


def _plan_after_state(state: Any, accumulation: Any, handlers: dict, fsdp_plugin: Any, deepspeed_plugin: Any,
                      named_plugins: Any, parallelism_config: Any, dynamo_plugin: Any,
                      gradient_accumulation_steps: int, gradient_accumulation_plugin: Any,
                      dataloader_config: Any) -> "Plan":
    """The decisions that need the process state (device, distributed type)."""
    gradient_state = GradientState(accumulation)
    if fsdp_plugin == "from-environment":
        from .utils.fsdp_plugin import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()
    fp8 = fp8_plan(handlers, state.mixed_precision, state.device,
                   sharded=state.distributed_type == DistributedType.FSDP)
    if deepspeed_plugin is not None:
        deepspeed_plugin = deepspeed_plugin_from(deepspeed_plugin)
        state.deepspeed_plugin = deepspeed_plugin
        state.deepspeed_plugins = named_plugins
        for plugin in (named_plugins or {}).values():
            plugin._unselect()
        deepspeed_plugin.select(_from_accelerator_state=True)
    steps = gradient_state.num_steps
    if state.distributed_type == DistributedType.DEEPSPEED:
        explicit = gradient_accumulation_steps != 1 or gradient_accumulation_plugin is not None
        steps = _agree_with_deepspeed(deepspeed_plugin, gradient_state, steps, explicit=explicit)
        for plugin in (named_plugins or {}).values():  # every engine steps with the same accumulation
            if plugin is not deepspeed_plugin:
                _agree_with_deepspeed(plugin, gradient_state, steps, explicit=True)
    return Plan(
        state=state, gradient_state=gradient_state, distributed_type=state.distributed_type,
        strategy=strategy_for(state.distributed_type, parallelism_config).name,
        mixed_precision=state.mixed_precision, parallelism_config=parallelism_config, fsdp_plugin=fsdp_plugin,
        deepspeed_plugin=deepspeed_plugin, fp8=fp8, dynamo_plugin=dynamo_plugin, gradient_accumulation_steps=steps,
        handlers=handlers, dataloader_config=dataloader_config,
        activation_checkpointing=_activation_checkpointing(handlers, fsdp_plugin, state.distributed_type),
    )


def _activation_checkpointing(handlers: dict[type, Any], fsdp_plugin: Any,
                              distributed_type: DistributedType) -> Optional[ActivationCheckpointingKwargs]:
    """The one activation-checkpointing setting: the handler, else the FSDP plugin's flags (full
    checkpointing of the layers its auto-wrap policy picks, its inputs offloaded with
    ``activation_checkpointing_offload``); both at once is an error, as is the handler with DeepSpeed."""
    setting = handlers.get(ActivationCheckpointingKwargs)
    flag = bool(getattr(fsdp_plugin, "activation_checkpointing", False))
    if setting is not None and flag:
        raise ValueError("activation checkpointing is set twice: FullyShardedDataParallelPlugin(activation_checkpointing="
                         "True) and ActivationCheckpointingKwargs; keep one (the kwargs handler offers every mode)")
    if setting is not None and distributed_type == DistributedType.DEEPSPEED:
        raise ValueError("ActivationCheckpointingKwargs is not supported with DeepSpeed; use the DeepSpeed config's "
                         "activation_checkpointing section or model.gradient_checkpointing_enable()")
    if flag:
        return ActivationCheckpointingKwargs(offload=bool(fsdp_plugin.activation_checkpointing_offload))
    return setting


def _dynamo(backend: Optional[str], plugin: Optional[TorchDynamoPlugin]) -> Optional[TorchDynamoPlugin]:
    """The compile settings: the plugin, else one for ``backend``, else ``HASTEN_DYNAMO_*``; None for "no"."""
    if plugin is None:
        plugin = TorchDynamoPlugin(backend=backend) if backend else dynamo_from_env()
    if plugin is not None and plugin.backend == "no":
        return None
    return plugin


def _agree_with_deepspeed(plugin: Any, gradient_state: GradientState, steps: int, explicit: bool) -> int:
    """DeepSpeed's config and the Accelerator agree on the accumulation steps (the config fills in
    what the script left out, the script fills the config's "auto"); the gradient state follows."""
    from .strategies.deepspeed_config import agree_accumulation

    agreed = agree_accumulation(plugin, steps, explicit)
    # As the Accelerator's gradient_accumulation_steps setter does (1 there means "the environment's").
    gradient_state.plugin_kwargs["num_steps"] = accumulation_plugin(agreed, None).num_steps
    return gradient_state.num_steps


__all__ = ["Plan", "make_plan"]


def parallelism_from_tp_plugin(torch_tp_plugin: Any, parallelism_config: Any) -> Any:
    """The ``parallelism_config`` an ``Accelerator`` given ``torch_tp_plugin`` runs with (Accelerate's translation)."""
    if torch_tp_plugin is None:
        return parallelism_config
    if not isinstance(getattr(torch_tp_plugin, "tp_size", None), int):
        raise TypeError(f"torch_tp_plugin must be a TorchTensorParallelPlugin, got {type(torch_tp_plugin).__name__}")
    warnings.warn("TorchTensorParallelPlugin is deprecated (as in Accelerate); pass "
                  "parallelism_config=ParallelismConfig(tp_size=...) instead", FutureWarning, stacklevel=3)
    if parallelism_config is not None:
        raise ValueError("pass torch_tp_plugin or parallelism_config, not both (set tp_size in the ParallelismConfig)")
    return ParallelismConfig(tp_size=torch_tp_plugin.tp_size)
