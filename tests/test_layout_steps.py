"""The layout is declared once: every axis of ``hasten.layout.AXIS_TABLE`` reaches the config file, the
launcher, ``ParallelismConfig`` and the mesh; and every engine lays a module out with the same steps
in the same order (``strategies/layout_steps.py``)."""

import dataclasses
from types import SimpleNamespace

from torch import nn

from hasten.commands.config_schema import SECTIONS
from hasten.commands.launch import launch_command_parser
from hasten.layout import AXES, AXIS_TABLE, DATA_AXES, Layout
from hasten.strategies.layout_steps import STEPS, Target, lay_out, steps_for
from hasten.strategies.mesh import DIMS
from hasten.utils.parallelism_config import ParallelismConfig


def test_every_axis_of_the_table_reaches_config_launcher_fields_and_mesh():
    keys = SECTIONS["parallelism_config"]
    flags = {a.dest for a in launch_command_parser()._actions}
    config_fields = {f.name for f in dataclasses.fields(ParallelismConfig)}
    layout_fields = {f.name for f in dataclasses.fields(Layout)}
    for axis in AXIS_TABLE:
        name = f"parallelism_config_{axis.name}_size"
        assert name in keys and name in flags, name
        assert f"{axis.name}_size" in config_fields and axis.name in layout_fields, axis.name
    assert DIMS == AXES == ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")  # Accelerate's order, with pp
    assert DATA_AXES == ("dp_replicate", "dp_shard")
    sizes = ParallelismConfig(pp_size=2, dp_shard_size=3, tp_size=5).sizes()
    assert sizes == {"pp": 2, "dp_replicate": 1, "dp_shard": 3, "cp": 1, "sp": 1, "tp": 5}
    assert ParallelismConfig(dp_replicate_size=2, sp_size=3).total_size == 6  # sp counts, as in Accelerate


def _target(module, whole=None, checkpoint=None, shard=None, **sizes):
    mesh = SimpleNamespace(sizes=dict(sizes))
    return Target(module, mesh, None, whole if whole is not None else module, checkpoint=checkpoint, shard=shard)


def test_the_steps_a_module_needs_come_in_one_order():
    assert [s.name for s in STEPS] == ["context_parallel", "sequence_parallel", "tensor_plan", "expert_parallel",
                                       "activation_checkpointing", "sharding"]
    model = nn.Linear(2, 2)
    noop = lambda m: None  # noqa: E731
    assert [s.name for s in steps_for(_target(model))] == []
    assert [s.name for s in steps_for(_target(model, checkpoint=noop, shard=noop))] == \
        ["activation_checkpointing", "sharding"]
    assert [s.name for s in steps_for(_target(model, checkpoint=noop, shard=noop, cp=2, tp=2, ep=2))] == \
        [s.name for s in STEPS if s.name != "sequence_parallel"]
    assert [s.name for s in steps_for(_target(model, shard=noop, sp=2))] == ["sequence_parallel", "sharding"]
    assert _target(nn.Linear(2, 2), whole=model).is_stage and not _target(model).is_stage


def test_lay_out_applies_the_engine_steps_in_order():
    seen = []
    done = lay_out(_target(nn.Linear(2, 2), checkpoint=lambda m: seen.append("checkpoint"),
                           shard=lambda m: seen.append("shard")))
    assert seen == ["checkpoint", "shard"] and done == ["activation_checkpointing", "sharding"]


def test_context_parallelism_is_refused_only_where_it_has_no_kernel():
    from hasten.layout import Layout

    layout = Layout.from_sizes({"dp_shard": 1, "cp": 2}, world_size=2)
    assert layout.device_problem("cpu") is None and layout.device_problem("cuda") is None
    problem = layout.device_problem("xpu")
    assert "cp_size=2 runs on CUDA or the CPU, not on xpu" in problem and "sp_size=2" in problem
    assert "\n" not in problem


def test_sequence_parallelism_under_deepspeed_needs_deepspeed():
    """sp under DeepSpeed runs DeepSpeed's Ulysses (test_sequence_split_deepspeed.py); sp_backend='deepspeed'
    without DeepSpeed's engine is one clear refusal naming both ways out."""
    import pytest

    with pytest.raises(ValueError) as info:
        ParallelismConfig(sp_size=2, sp_backend="deepspeed").check(2, sharded=False, device_type="cpu", deepspeed=False)
    text = str(info.value)
    assert "sp_size=2 with sp_backend='deepspeed'" in text and "pass a deepspeed_plugin" in text
    assert "sp_backend='hasten'" in text and "\n" not in text
    for config in (ParallelismConfig(sp_size=2), ParallelismConfig(sp_size=2, sp_backend="deepspeed")):
        config.check(2, sharded=False, device_type="cpu", deepspeed=True)  # DeepSpeed's Ulysses
    ParallelismConfig(sp_size=2).check(2, sharded=False, device_type="cpu")  # hasten's own, under DDP


def test_cpu_ring_attention_names_the_torch_version_when_its_private_ring_changed(monkeypatch):
    """The CPU path of context parallelism drives torch's private ring code: a torch without it is one
    clear error naming the version and the way out, not an AttributeError deep inside a step."""
    import pytest
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from hasten.strategies import ring_attention

    monkeypatch.delattr(_attention, "_templated_ring_attention")  # what a later torch may do
    with pytest.raises(RuntimeError, match=r"torch \S+ differs.*sp_size"):
        ring_attention.load_balancing()
