"""Accelerate's CLI modules under hasten's name: the config dataclasses, the programmatic launch
helpers (``hasten.utils.launch``, ``launch_command_parser``, ``_validate_launch_command``), the
parsers of each command, and the exception types Accelerate's callers catch. Torch-free, no launch."""

import argparse
import os
import sys

import pytest
import yaml

from hasten.commands.launch import build_plan, launch_command_parser, run_plan

SCRIPT_ARGS = ["--lr", "0.1"]


def _yaml(path, data):
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return str(path)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import os, sys\nsys.exit(0)\n")
    return str(path)


@pytest.fixture
def no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path / "absent.yaml"))


# --------------------------------------------------------------------------- config package
def test_config_is_a_package_with_accelerates_submodules():
    from hasten.commands.config import default, update, write_basic_config
    from hasten.commands.config.config_args import (  # noqa: F401
        BaseConfig, ClusterConfig, SageMakerConfig, default_config_file, load_config_from_file,
    )

    assert default.write_basic_config is write_basic_config
    assert callable(update.update_command)


def test_load_config_from_file_reads_what_the_launcher_reads(tmp_path):
    from hasten.commands.config.config_args import ClusterConfig, load_config_from_file

    path = _yaml(tmp_path / "c.yaml", {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
                                      "fp16": True, "num_processes": 4, "use_cpu": True,
                                      "fsdp_config": {"fsdp_ignored_modules": None}})
    config = load_config_from_file(path)
    assert isinstance(config, ClusterConfig)
    assert (config.distributed_type, config.mixed_precision, config.num_processes) == ("MULTI_CPU", "fp16", 4)
    assert config.fsdp_config == {} and config.deepspeed_config == {}
    again = tmp_path / "again.yaml"
    config.to_yaml_file(str(again))
    assert load_config_from_file(str(again)) == config


def test_load_config_from_file_errors(tmp_path):
    from hasten.commands.config.config_args import load_config_from_file

    with pytest.raises(FileNotFoundError, match="absent.yaml"):
        load_config_from_file(str(tmp_path / "absent.yaml"))
    bad = _yaml(tmp_path / "bad.yaml", {"distributed_type": "NO", "invalid_key": 1})
    with pytest.raises(ValueError, match="invalid_key"):
        load_config_from_file(bad)


def test_sagemaker_config_is_read_not_launched(tmp_path, script):
    from hasten.commands.config.config_args import SageMakerConfig, load_config_from_file

    path = tmp_path / "sm.yaml"
    path.write_text("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\nmixed_precision: fp16\n"
                    "use_cpu: false\ndebug: false\nec2_instance_type: MY_TYPE\niam_role_name: MY_ROLE\n")
    config = load_config_from_file(str(path))
    assert isinstance(config, SageMakerConfig)
    assert (config.distributed_type, config.ec2_instance_type) == ("NO", "MY_TYPE")
    args = launch_command_parser().parse_args(["--config_file", str(path), script])
    with pytest.raises(ValueError, match="AMAZON_SAGEMAKER is not supported"):
        build_plan(args)


# --------------------------------------------------------------------------- launch_command_parser
def test_programmatic_parser_fills_defaults_and_config_still_counts(tmp_path, script, no_user_config):
    from hasten.commands.launch import _validate_launch_command

    parser = launch_command_parser()
    assert parser.parse_args([script]).multi_gpu is False
    typed = parser.parse_args(["--multi-gpu", "--num-processes", "4", script])
    assert (typed.multi_gpu, typed.num_processes) == (True, 4)

    cfg = _yaml(tmp_path / "c.yaml", {"distributed_type": "MULTI_CPU", "use_cpu": True, "num_processes": 3,
                                     "debug": True, "fsdp_config": {"fsdp_sync_module_states": False}})
    args = parser.parse_args(["--config_file", cfg, script])
    assert args.num_processes is None and args.debug is False  # defaults until resolved
    assert build_plan(args).num_processes == 3  # a filled-in default does not hide the config file
    args = parser.parse_args(["--config_file", cfg, "--num_processes", "2", script])
    args, config, mp_from_config = _validate_launch_command(args)
    assert (args.num_processes, args.debug, args.fsdp_sync_module_states) == (2, True, False)
    assert config.num_processes == 3 and mp_from_config is False


def test_help_names_the_hyphen_spelling_once():
    text = launch_command_parser().format_help()
    assert text.count("--num-processes") == 1 and "--config-file" not in text


def test_fsdp_ignored_modules_reaches_the_processes(tmp_path, script, no_user_config):
    cfg = _yaml(tmp_path / "c.yaml", {"distributed_type": "FSDP", "use_cpu": True, "num_processes": 2,
                                     "fsdp_config": {"fsdp_version": 2, "fsdp_ignored_modules": "lm_head"}})
    plan = build_plan(launch_command_parser().parse_args(["--config_file", cfg, script]))
    assert plan.child_env["FSDP_IGNORED_MODULES"] == "lm_head"


def test_run_plan_leaves_the_callers_environment_alone(script, no_user_config):
    before = dict(os.environ)
    plan = build_plan(launch_command_parser().parse_args(["--cpu", "--mixed_precision", "bf16", script]))
    assert plan.direct and plan.child_env
    assert run_plan(plan, exec_ok=False) == 0
    assert dict(os.environ) == before


# --------------------------------------------------------------------------- hasten.utils.launch
def test_prepare_simple_launcher_cmd_env(script, no_user_config):
    from hasten.utils.launch import prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(["--cpu", "--mixed_precision", "bf16", script, *SCRIPT_ARGS])
    cmd, env = prepare_simple_launcher_cmd_env(args)
    assert cmd == [sys.executable, script, *SCRIPT_ARGS]
    assert env["HASTEN_MIXED_PRECISION"] == "bf16" and env["PATH"] == os.environ["PATH"]


def test_prepare_multi_gpu_env_picks_a_free_port(no_user_config):
    from hasten.utils.launch import prepare_multi_gpu_env

    # A namespace built by hand, as Accelerate's tests do: None means "not set".
    args = argparse.Namespace(num_processes=2, num_machines=1, main_process_ip="127.0.0.1", main_process_port=0,
                              machine_rank=0, use_cpu=True, mixed_precision="no", fsdp_version=None)
    env = prepare_multi_gpu_env(args)
    assert args.master_port.isdigit() and args.master_port != "0"
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("2", "1", "0")
    assert env["OMP_NUM_THREADS"]


def test_mpirun_config_is_refused_with_the_alternative(tmp_path, script, no_user_config, capsys):
    from hasten.commands.cli import main
    from hasten.utils.launch import prepare_simple_launcher_cmd_env

    # Accelerate starts these processes through mpirun; ignoring the hostfile would wait for 3 machines.
    cfg = _yaml(tmp_path / "mpi.yaml", {"distributed_type": "MULTI_CPU", "use_cpu": True, "num_processes": 16,
                                       "num_machines": 4, "main_process_ip": "127.0.0.1",
                                       "mpirun_config": {"mpirun_hostfile": "/etc/hosts"}})
    with pytest.raises(ValueError, match="mpirun -ppn 1"):
        prepare_simple_launcher_cmd_env(launch_command_parser().parse_args(["--config_file", cfg, script]))
    assert main(["launch", "--config_file", cfg, script]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hasten launch does not start processes through mpirun" in err


def test_convert_nargs_to_dict():
    from hasten.utils.launch import _convert_nargs_to_dict

    out = _convert_nargs_to_dict(["--name", "bert", "--do_train", "False", "--epochs", "3", "--lr", "5e-5",
                                  "--max_steps", "50.5", "--shift", "-1"])
    assert out == {"name": "bert", "do_train": False, "epochs": 3, "lr": 5e-5, "max_steps": 50.5, "shift": -1}
    assert type(out["epochs"]) is int and type(out["lr"]) is float
    with pytest.raises(ValueError, match="--do_train has no value"):
        _convert_nargs_to_dict(["--do_train", "--epochs", "3"])


def test_sagemaker_and_tpu_launches_are_refused():
    from hasten.commands.tpu import tpu_command_launcher, tpu_command_parser
    from hasten.utils.compat import FeatureNotAvailableError
    from hasten.utils.launch import prepare_sagemager_args_inputs, prepare_tpu

    args = tpu_command_parser().parse_args(["--tpu_name", "t", "--command", "ls", "--debug"])
    for call in (lambda: tpu_command_launcher(args), prepare_tpu, prepare_sagemager_args_inputs):
        with pytest.raises(FeatureNotAvailableError, match="not available in hasten"):
            call()


def test_launch_module_refusals_are_hasten_utils_stand_ins():
    import hasten.utils
    import hasten.utils.launch

    for name in ("prepare_tpu", "prepare_sagemager_args_inputs", "PrepareForLaunch"):
        assert getattr(hasten.utils, name) is getattr(hasten.utils.launch, name)


# --------------------------------------------------------------------------- other commands' names
def test_cli_errors_are_value_errors_and_file_errors(tmp_path):
    from hasten.commands.errors import HastenCLIError
    from hasten.commands.to_fsdp2 import convert_config_to_fsdp2, to_fsdp2_command, to_fsdp2_command_parser

    assert issubclass(HastenCLIError, ValueError)
    parser = to_fsdp2_command_parser()
    with pytest.raises(FileNotFoundError):
        to_fsdp2_command(parser.parse_args(["--config_file", str(tmp_path / "absent.yaml")]))
    src = _yaml(tmp_path / "in.yaml", {"distributed_type": "FSDP",
                                      "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})
    out = _yaml(tmp_path / "out.yaml", {})
    with pytest.raises(FileExistsError):
        to_fsdp2_command(parser.parse_args(["--config_file", src, "--output_file", out]))
    with pytest.raises(ValueError, match="--output_file"):
        to_fsdp2_command(parser.parse_args(["--config_file", src]))
    assert convert_config_to_fsdp2({"fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})["fsdp_config"] == {
        "fsdp_reshard_after_forward": True, "fsdp_version": 2}


def test_estimate_gather_data_and_offline_refusal():
    from hasten.commands.estimate import estimate_command, estimate_command_parser, gather_data

    parser = estimate_command_parser()
    args = parser.parse_args(["torch.nn:Linear", "--model_kwargs", '{"in_features": 4, "out_features": 2}',
                              "--dtypes", "float32", "float16"])
    rows = gather_data(args)
    assert [r[:3] for r in rows] == [["float32", 40, 40], ["float16", 20, 20]]
    assert rows[0][3]["single"] > 40 and set(rows[0][3]) >= {"DDP", "FSDP2"}
    with pytest.raises(FileNotFoundError, match="never downloads"):  # an OSError, as for a missing Hub repo
        estimate_command(parser.parse_args(["some-org/some-model"]))


def test_test_command_parser():
    from hasten.commands.test import test_command_parser

    assert test_command_parser().parse_args(["--cpu"]).use_cpu is True


def test_beta_version_constants():
    from hasten.utils import constants

    assert constants.BETA_CP_AVAILABLE_PYTORCH_VERSION == "2.6.0"
    assert constants.BETA_TP_AVAILABLE_TRANSFORMERS_VERSION == "4.52.0"
