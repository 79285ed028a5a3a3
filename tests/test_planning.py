"""The run's plan: one decision function for the distributed type and the strategy, read by the
process state, the strategy registry and the facade alike."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hasten import Accelerator, AcceleratorState
from hasten.strategy_rules import RULES, distributed_type_for, strategy_for, strategy_rule
from hasten.utils.dataclasses import DistributedType
from hasten.utils.parallelism_config import ParallelismConfig


@pytest.mark.parametrize("kind, tp, name", [
    (DistributedType.NO, 1, "single"),
    (DistributedType.MULTI_CPU, 1, "ddp"),
    (DistributedType.MULTI_GPU, 1, "ddp"),
    (DistributedType.MULTI_CPU, 2, "tensor_parallel"),
    (DistributedType.FSDP, 1, "fsdp2"),
    (DistributedType.FSDP, 2, "fsdp2"),  # FSDP2 applies the tensor-parallel plan itself
    (DistributedType.DEEPSPEED, 1, "deepspeed"),
    (DistributedType.DEEPSPEED, 2, "deepspeed"),
])
def test_strategy_rules_name_one_strategy_per_layout(kind, tp, name):
    config = ParallelismConfig(tp_size=tp) if tp > 1 else None
    assert strategy_for(kind, config).name == name


def test_every_rule_names_an_importable_strategy_class():
    from hasten.strategies import Strategy, strategy_class

    for rule in RULES:
        cls = strategy_class(rule.name)
        assert issubclass(cls, Strategy) and cls.__name__ == rule.where.split(":")[1]
    with pytest.raises(ValueError, match="no strategy named 'zero_bubble'"):
        strategy_rule("zero_bubble")


def test_pipeline_rule_wins_when_pp_size_is_above_one():
    assert strategy_for(DistributedType.MULTI_CPU, ParallelismConfig(pp_size=2)).name == "pipeline"
    assert strategy_for(DistributedType.MULTI_CPU, ParallelismConfig(tp_size=2)).name == "tensor_parallel"
    assert strategy_for(DistributedType.MULTI_CPU, None).name == "ddp"


def test_distributed_type_for_prefers_deepspeed_then_fsdp_then_the_process_layout():
    assert distributed_type_for(DistributedType.MULTI_GPU) == DistributedType.MULTI_GPU
    assert distributed_type_for(DistributedType.NO, fsdp_plugin="from-environment") == DistributedType.FSDP
    assert distributed_type_for(DistributedType.MULTI_CPU, deepspeed_plugin=object(),
                                fsdp_plugin=object()) == DistributedType.DEEPSPEED


def test_tensor_parallel_does_not_inherit_fsdp2():
    from hasten.strategies.dtensor import DTensorStrategy
    from hasten.strategies.fsdp2 import FSDP2Strategy
    from hasten.strategies.tensor_parallel import TensorParallelStrategy

    assert not issubclass(TensorParallelStrategy, FSDP2Strategy)
    assert issubclass(TensorParallelStrategy, DTensorStrategy) and issubclass(FSDP2Strategy, DTensorStrategy)


def test_the_accelerator_reads_one_plan(fresh_state):
    acc = Accelerator(gradient_accumulation_steps=3)
    plan = acc.plan
    assert plan.state is acc.state and plan.gradient_state is acc.gradient_state
    assert plan.distributed_type == acc.distributed_type == AcceleratorState().distributed_type
    assert plan.strategy == "single" and type(acc.strategy).__name__ == "SingleDeviceStrategy"
    assert plan.mixed_precision == acc.mixed_precision == "no"
    assert plan.gradient_accumulation_steps == acc.gradient_accumulation_steps == 3
    assert plan.fp8 is None and acc.fp8 is None and plan.dynamo_plugin is None


def test_importing_hasten_imports_no_strategy_and_no_planner():
    code = ("import sys, hasten; "
            "print(sorted(m for m in sys.modules if m.startswith(('hasten.strategies', 'hasten.planning'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
