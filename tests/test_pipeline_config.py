"""The pipeline's part of the layout: ``ParallelismConfig``'s pp fields, the torch-free ``Layout`` that holds
every axis, and ``hasten launch --parallelism_config_pp_*`` (refused in one line, exit 2, before any process)."""

import inspect
import os
import re

import pytest

from scripts.launch_common import clean_env, hasten, script
from test_cli import one_line_error, plan_for


@pytest.fixture(autouse=True)
def no_layout_environment(monkeypatch):
    for key in list(os.environ):
        if key.startswith("PARALLELISM_CONFIG_"):
            monkeypatch.delenv(key)


# -- ParallelismConfig: the pp fields ---------------------------------------------------------------
def test_pp_fields_defaults_and_environment(monkeypatch):
    from hasten.utils import ParallelismConfig

    p = ParallelismConfig()
    assert (p.pp_size, p.pp_schedule, p.pp_microbatches, p.pp_stages_per_rank, p.pp_split_points) == (
        1, "1F1B", 1, 1, None)
    p = ParallelismConfig(pp_size=2, pp_schedule="interleaved1f1b", pp_microbatches=8)
    assert (p.pp_schedule, p.pp_stages_per_rank, p.pp_stages, p.total_size) == ("Interleaved1F1B", 2, 4, 2)
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SCHEDULE", "GPipe")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_MICROBATCHES", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SPLIT_POINTS", "layers.2")
    p = ParallelismConfig()
    assert (p.pp_size, p.pp_schedule, p.pp_microbatches, p.pp_split_points) == (2, "GPipe", 4, ["layers.2"])


@pytest.mark.parametrize("kwargs, named", [
    (dict(pp_size=0), "pp_size=0"),
    (dict(pp_size=2, pp_schedule="1f1c"), "did you mean '1F1B'"),
    (dict(pp_size=4, pp_microbatches=2), "pp_microbatches=2 is fewer than the 4 pipeline stages"),
    (dict(pp_size=2, pp_schedule="ZBVZeroBubble", pp_stages_per_rank=3), "exactly 2 stages per process"),
    (dict(pp_size=2, pp_schedule="GPipe", pp_stages_per_rank=2), "runs one stage per process"),
    (dict(pp_size=2, pp_split_points=["a", "b"]), "need 1"),
    (dict(pp_size=2, pp_split_points="layers.1"), "must be a list of module names"),
])
def test_pp_errors_name_the_value(kwargs, named):
    from hasten.utils import ParallelismConfig

    with pytest.raises(ValueError, match=re.escape(named)):
        ParallelismConfig(**kwargs)


def test_pp_schedules_are_torch_registry():
    """The torch-free list is the schedules torch's registry can build (not its abstract bases)."""
    from torch.distributed.pipelining import schedules

    from hasten.utils.parallelism_config import PP_SCHEDULES

    registry = re.findall(r'"(\w+)":\s*\w+', inspect.getsource(schedules.get_schedule_class))
    assert registry, "torch's get_schedule_class no longer holds its registry as a dict literal"
    concrete = [name for name in registry if not name.startswith("PipelineSchedule")]
    assert sorted(PP_SCHEDULES) == sorted(concrete)
    for name in PP_SCHEDULES:
        assert schedules.get_schedule_class(name).__name__ == "Schedule" + name


# -- the Layout object --------------------------------------------------------------------------------
def test_layout_holds_every_axis_in_mesh_order():
    from hasten.layout import AXES, Layout
    from hasten.strategies.mesh import DIMS
    from hasten.utils import ParallelismConfig

    assert AXES == DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
    layout = Layout.from_config(ParallelismConfig(pp_size=2, dp_shard_size=2, tp_size=2), world_size=8)
    assert (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep) == (2, 1, 2, 1, 2, 1)
    assert layout.enabled == ("pp", "dp_shard", "tp") and layout.product == 8
    assert layout.mesh_names_and_shape() == (("pp", "dp_shard", "tp"), (2, 2, 2))
    assert layout.dp_size == 2 and layout.dp_enabled and layout.pp_enabled and not layout.cp_enabled
    with pytest.raises(ValueError, match=r"pp_size=2 x dp_replicate_size=1 x dp_shard_size=2 x cp_size=1 x "
                                         r"tp_size=2 = 8 processes, but this job runs 4"):
        Layout.from_config(ParallelismConfig(pp_size=2, dp_shard_size=2, tp_size=2), world_size=4).check()
    assert Layout(world_size=2, dp_shard=2, ep=2).check().product == 2  # ep borrows dp_shard: no factor
    with pytest.raises(ValueError, match="ep_size=4 does not divide dp_shard_size=2"):
        Layout(world_size=2, dp_shard=2, ep=4).check()
    with pytest.raises(ValueError, match="tp_size=0 must be a whole number >= 1"):
        Layout(world_size=2, tp=0)


def test_config_mesh_and_layout_share_one_product_rule():
    from hasten.strategies.mesh import check_layout
    from hasten.utils import ParallelismConfig

    with pytest.raises(ValueError) as by_config:
        ParallelismConfig(pp_size=2, tp_size=2).check(2, sharded=False, device_type="cpu")
    with pytest.raises(ValueError) as by_mesh:
        check_layout({"pp": 2, "tp": 2}, 2)
    core = "pp_size=2 x dp_replicate_size=1 x dp_shard_size=1 x cp_size=1 x tp_size=2 = 4 processes, but this job runs 2"
    assert core in str(by_config.value) and core in str(by_mesh.value)


# -- hasten launch: flags, config keys, refusals ------------------------------------------------------
from test_agree_and_launch_sizes import cli  # noqa: E402,F401 - the same clean launcher environment


def test_pp_flags_reach_the_processes(cli):
    plan = plan_for("--cpu", "--num_processes", "4", "--parallelism_config_pp_size", "2",
                    "--parallelism_config_dp_shard_size", "2", "--parallelism_config_pp_schedule", "gpipe",
                    "--parallelism_config_pp_microbatches", "4", "--parallelism_config_pp_split_points",
                    "layers.2", "train.py")
    env = plan.child_env
    assert (env["PARALLELISM_CONFIG_PP_SIZE"], env["PARALLELISM_CONFIG_PP_SCHEDULE"],
            env["PARALLELISM_CONFIG_PP_MICROBATCHES"], env["PARALLELISM_CONFIG_PP_SPLIT_POINTS"]) == (
        "2", "gpipe", "4", "layers.2")
    plan = plan_for("--cpu", "--num_processes", "2", "--parallelism_config_pp_size", "2",
                    "--parallelism_config_pp_schedule", "Interleaved1F1B", "--parallelism_config_pp_stages_per_rank",
                    "2", "--parallelism_config_pp_microbatches", "4", "train.py")
    assert plan.child_env["PARALLELISM_CONFIG_PP_STAGES_PER_RANK"] == "2"


def test_pp_config_file_keys(cli):
    cfg = cli / "cfg.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nparallelism_config:\n"
                   "  parallelism_config_pp_size: 2\n  parallelism_config_pp_schedule: GPipe\n"
                   "  parallelism_config_pp_microbatches: 4\n  parallelism_config_pp_split_points: [layers.3]\n")
    env = plan_for("--config_file", str(cfg), "train.py").child_env
    assert (env["PARALLELISM_CONFIG_PP_SIZE"], env["PARALLELISM_CONFIG_PP_SCHEDULE"],
            env["PARALLELISM_CONFIG_PP_MICROBATCHES"], env["PARALLELISM_CONFIG_PP_SPLIT_POINTS"]) == (
        "2", "GPipe", "4", "layers.3")


@pytest.mark.parametrize("argv, fragments", [
    (["--num_processes", "2", "--parallelism_config_pp_size", "2", "--parallelism_config_tp_size", "2"],
     ["pp_size 2 (command line --parallelism_config_pp_size)", "tp_size 2", "= 4 processes", "runs 2",
      "--num_processes 4"]),
    (["--num_processes", "4", "--parallelism_config_pp_size", "4", "--parallelism_config_pp_microbatches", "2"],
     ["pp_microbatches=2 is fewer than the 4 pipeline stages", "command line --parallelism_config_pp_microbatches"]),
    (["--num_processes", "2", "--parallelism_config_pp_size", "2", "--parallelism_config_pp_schedule", "1f1c"],
     ["pp_schedule='1f1c' is not a pipeline schedule", "did you mean '1F1B'"]),
    (["--num_processes", "2", "--parallelism_config_pp_size", "2", "--parallelism_config_pp_split_points", "a,b"],
     ["pp_split_points has 2 names", "need 1"]),
])
def test_bad_pipeline_layouts_are_one_line_exit_2(cli, capsys, argv, fragments):
    err = one_line_error(capsys, ["launch", "--cpu", *argv, "train.py"])
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_real_command_refuses_pipeline_layout_before_any_process(tmp_path):
    env = clean_env(tmp_path / "absent.yaml", CUDA_VISIBLE_DEVICES="")
    for sizes in (["--parallelism_config_pp_size", "3"],
                  ["--parallelism_config_pp_size", "2", "--parallelism_config_pp_schedule", "gpipee"],
                  ["--parallelism_config_pp_size", "2", "--parallelism_config_pp_microbatches", "1"]):
        rc, out, err, _ = hasten(["launch", "--cpu", "--num_processes", "2", *sizes, script("launch_env.py"),
                                  tmp_path], env, timeout=60)
        assert rc == 2, (rc, out, err)
        assert err.startswith("hasten: error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
        assert "pp_" in err and "unknown flag" not in err, err
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".json")], "a process started"
