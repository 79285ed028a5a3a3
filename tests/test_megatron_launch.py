"""``hasten launch --use_megatron_lm`` (Accelerate's flags, variables and megatron_lm_config section) on the
native layout: the plan inspected without processes, refusals in one line (exit 2), and one real run."""

import json
import os

import pytest

from scripts.launch_common import clean_env, hasten, script
from test_agree_and_launch_sizes import cli  # noqa: F401 - the same clean launcher environment
from test_cli import one_line_error, plan_for

ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
megatron_lm_config:
  megatron_lm_gradient_clipping: 1.0
  megatron_lm_learning_rate_decay_iters: 320000
  megatron_lm_num_micro_batches: 4
  megatron_lm_pp_degree: 2
  megatron_lm_recompute_activations: false
  megatron_lm_sequence_parallelism: false
  megatron_lm_tp_degree: 1
mixed_precision: 'no'
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: true
"""


def test_flags_map_onto_the_native_layout(cli, capsys):
    plan = plan_for("--cpu", "--num_processes", "4", "--use_megatron_lm", "--megatron_lm_tp_degree", "2",
                    "--megatron_lm_pp_degree", "2", "--megatron_lm_num_micro_batches", "4", "train.py")
    env = plan.child_env
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["PARALLELISM_CONFIG_PP_SIZE"],
            env["PARALLELISM_CONFIG_PP_MICROBATCHES"], env["HASTEN_USE_PARALLELISM_CONFIG"]) == ("2", "2", "4", "true")
    assert (env["MEGATRON_LM_TP_DEGREE"], env["MEGATRON_LM_PP_DEGREE"]) == ("2", "2")  # a script's own plugin agrees
    assert "ACCELERATE_USE_MEGATRON_LM" not in env
    assert plan.res.values["parallelism_config_pp_size"].source == (
        "command line --megatron_lm_pp_degree (Megatron-LM, mapped)")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["hasten: warning: MegatronLMPlugin mapped to ParallelismConfig(tp_size=2, pp_size=2, "
                        "pp_microbatches=4, pp_schedule='1F1B'); Megatron's own train step is not used"], warnings


def test_accelerate_config_file_and_leftover_processes_are_data_parallel(cli, capsys):
    cfg = cli / "megatron.yaml"
    cfg.write_text(ACCELERATE_CONFIG)
    env = plan_for("--config_file", str(cfg), "train.py").child_env
    assert (env["PARALLELISM_CONFIG_PP_SIZE"], env["PARALLELISM_CONFIG_PP_MICROBATCHES"],
            env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"]) == ("2", "4", "2")
    err = capsys.readouterr().err
    assert err.count("hasten: warning: MegatronLMPlugin mapped to ParallelismConfig(dp_replicate_size=2, tp_size=1, "
                     "pp_size=2, pp_microbatches=4") == 1, err
    assert "(not applied: megatron_lm_learning_rate_decay_iters)" in err


def test_accelerate_environment(cli, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    monkeypatch.setenv("MEGATRON_LM_PP_DEGREE", "2")
    env = plan_for("--cpu", "--num_processes", "2", "train.py").child_env
    assert env["PARALLELISM_CONFIG_PP_SIZE"] == "2"


def test_megatron_flags_without_use_megatron_lm_are_inert(cli):
    env = plan_for("--cpu", "--num_processes", "2", "--megatron_lm_pp_degree", "2", "train.py").child_env
    assert "PARALLELISM_CONFIG_PP_SIZE" not in env and "MEGATRON_LM_PP_DEGREE" not in env  # as in Accelerate


@pytest.mark.parametrize("argv, fragments", [
    (["--megatron_lm_sequence_parallelism", "true"],
     ["megatron_lm_sequence_parallelism=true (command line --megatron_lm_sequence_parallelism)", "cp_size"]),
    (["--megatron_lm_recompute_activations", "true"], ["megatron_lm_recompute_activations=true", "ActivationCheckpointing"]),
    (["--megatron_lm_use_distributed_optimizer", "true"], ["megatron_lm_use_distributed_optimizer=true", "FSDP2"]),
    (["--megatron_lm_num_micro_batches", "4"], ["without a pipeline", "--gradient_accumulation_steps 4"]),
    (["--megatron_lm_pp_degree", "2", "--parallelism_config_pp_size", "1"], ["disagree", "pp_size 1"]),
    (["--megatron_lm_tp_degree", "3"], ["tp_size 3 (command line --megatron_lm_tp_degree (Megatron-LM, mapped))",
                                        "this job runs 2"]),
])
def test_megatron_only_settings_are_one_line_exit_2(cli, capsys, argv, fragments):
    err = one_line_error(capsys, ["launch", "--cpu", "--num_processes", "2", "--use_megatron_lm", *argv, "train.py"])
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_refused_from_the_config_file(cli, capsys):
    cfg = cli / "megatron.yaml"
    cfg.write_text(ACCELERATE_CONFIG.replace("megatron_lm_sequence_parallelism: false",
                                             "megatron_lm_sequence_parallelism: true"))
    err = one_line_error(capsys, ["launch", "--config_file", str(cfg), "train.py"])
    assert f"megatron_lm_sequence_parallelism=true (config file {cfg}: megatron_lm_config." in err, err


@pytest.mark.parametrize("plugin", [False, True])
def test_real_run_on_the_native_pipeline_with_one_warning(tmp_path, plugin):
    env = clean_env(tmp_path / "absent.yaml", CUDA_VISIBLE_DEVICES="")
    rc, out, err, _ = hasten(["launch", "--cpu", "--num_processes", "2", "--use_megatron_lm", "--megatron_lm_pp_degree",
                              "2", "--megatron_lm_num_micro_batches", "2", script("launch_megatron.py"), tmp_path,
                              *(["plugin"] if plugin else [])], env, timeout=120)
    assert rc == 0, err
    assert err.count("MegatronLMPlugin mapped to ParallelismConfig(tp_size=1, pp_size=2, pp_microbatches=2") == 1, err
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["pp_size"], r["pp_microbatches"]) for r in ranks] == [(2, 2), (2, 2)]
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["losses"][1] < ranks[0]["losses"][0]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("hang")]
