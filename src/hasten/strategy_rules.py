"""Which distributed type and which strategy a configuration asks for: the decisions the planner
(``hasten.planning``) and the process state (``hasten.state.AcceleratorState``) share.

A leaf module (no torch, no hasten module above ``utils``) so that both can import it: the state
is built by users directly too (as in Accelerate), and must reach the same answer as the
Accelerator's plan without importing the planner.

Adding a strategy (say pipeline parallelism) means a module in ``hasten/strategies/`` and one
``StrategyRule`` in ``RULES``; nothing in the facade, the data layer or checkpointing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .utils.dataclasses import DistributedType


def distributed_type_for(process_type: DistributedType, deepspeed_plugin: Any = None,
                         fsdp_plugin: Any = None) -> DistributedType:
    """The run's distributed type: the process layout's (``NO``, ``MULTI_GPU``, ...) unless a plugin
    asks for an engine. DeepSpeed wins over FSDP; FSDP applies on one process too (a group of one),
    as Accelerate does under its launcher."""
    if deepspeed_plugin is not None:
        return DistributedType.DEEPSPEED
    if fsdp_plugin is not None:
        return DistributedType.FSDP
    return process_type


@dataclass(frozen=True)
class StrategyRule:
    """One strategy the planner can name.

    Attributes:
        name: the strategy's name in a plan (``Plan.strategy``).
        where: ``"module:Class"`` inside ``hasten.strategies``, imported only when chosen.
        serves: ``serves(distributed_type, parallelism_config)``: whether this strategy runs such a job
            (the config may be None: no layout asked for).
    """

    name: str
    where: str
    serves: Callable[[DistributedType, Any], bool]


# First match wins, so the order is the precedence: an engine the user asked for (FSDP2, which also
# applies a tensor-parallel plan; DeepSpeed) before tensor parallelism alone, before plain DDP.
RULES: tuple[StrategyRule, ...] = (
    StrategyRule("single", "single:SingleDeviceStrategy", lambda kind, cfg: kind == DistributedType.NO),
    # Before the engines: it refuses FSDP/DeepSpeed with pp itself, naming the combination, rather
    # than letting an engine silently ignore pp_size.
    StrategyRule("pipeline", "pipeline:PipelineStrategy", lambda kind, cfg: _size(cfg, "pp_size") > 1),
    StrategyRule("fsdp2", "fsdp2:FSDP2Strategy", lambda kind, cfg: kind == DistributedType.FSDP),
    StrategyRule("deepspeed", "deepspeed:DeepSpeedStrategy", lambda kind, cfg: kind == DistributedType.DEEPSPEED),
    StrategyRule("tensor_parallel", "tensor_parallel:TensorParallelStrategy", lambda kind, cfg: _size(cfg, "tp_size") > 1),
    StrategyRule("ddp", "ddp:DDPStrategy", lambda kind, cfg: True),
)


def _size(parallelism_config: Optional[Any], name: str) -> int:
    if parallelism_config is None:
        return 1
    return getattr(parallelism_config, name, None) or 1


def strategy_for(distributed_type: DistributedType, parallelism_config: Optional[Any] = None) -> StrategyRule:
    """The rule of the strategy that runs a job of ``distributed_type`` with ``parallelism_config``."""
    return next(rule for rule in RULES if rule.serves(distributed_type, parallelism_config))


def strategy_rule(name: str) -> StrategyRule:
    """The rule named ``name`` (a plan's ``strategy``)."""
    for rule in RULES:
        if rule.name == name:
            return rule
    raise ValueError(f"no strategy named {name!r}; known: {[rule.name for rule in RULES]}")
