"""`hasten config` (questionnaire on stdin, default, update, explain), the config file, `hasten env`."""

import io
import os
import subprocess
import sys

import pytest
import yaml

from hasten.commands.cli import main
from hasten.commands.config_schema import read_config, to_yaml_dict, validate, write_config
from scripts.launch_common import LEAKY_NAMES, LEAKY_PREFIXES

SEED_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: 29500
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""

# What older Accelerate versions wrote (legacy keys and values included).
LEGACY_YAML = """\
command_file: null
commands: null
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MULTI_GPU
downcast_bf16: 'no'
dynamo_backend: 'NO'
fp16: true
fsdp_config: {}
gpu_ids: all
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
num_machines: 1
num_processes: -1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_name: null
tpu_use_cluster: false
tpu_use_sudo: false
tpu_zone: null
use_cpu: false
"""

# `accelerate config default` writes JSON into default_config.yaml.
ACCELERATE_JSON = """{
  "compute_environment": "LOCAL_MACHINE", "debug": false, "distributed_type": "NO", "downcast_bf16": false,
  "enable_cpu_affinity": false, "machine_rank": 0, "main_training_function": "main", "mixed_precision": "no",
  "num_machines": 1, "num_processes": 1, "rdzv_backend": "static", "same_network": false,
  "tpu_use_cluster": false, "tpu_use_sudo": false, "use_cpu": true
}"""


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(LEAKY_PREFIXES) or key in LEAKY_NAMES:
            monkeypatch.delenv(key)
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path / "home" / "default_config.yaml"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)


def answer(monkeypatch, *lines):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))


# -- the file ---------------------------------------------------------------------------------
def test_round_trip_write_read_same(tmp_path):
    cfg = {"distributed_type": "FSDP", "num_processes": 4, "num_machines": 2, "machine_rank": 1,
           "main_process_ip": "10.0.0.1", "main_process_port": 29501, "gpu_ids": "0,1", "mixed_precision": "bf16",
           "rdzv_backend": "c10d", "gradient_accumulation_steps": 4, "dynamo_config": {"dynamo_backend": "INDUCTOR"},
           "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": True, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                           "fsdp_min_num_params": 1000}}
    path = write_config(str(tmp_path / "a.yaml"), cfg)
    back = read_config(path)
    for key, value in cfg.items():
        assert back[key] == value, key
    again = write_config(str(tmp_path / "b.yaml"), back)
    assert open(path).read() == open(again).read()
    raw = yaml.safe_load(open(path))
    for key in ("compute_environment", "distributed_type", "downcast_bf16", "gpu_ids", "machine_rank",
                "main_process_ip", "main_process_port", "mixed_precision", "num_machines", "num_processes", "use_cpu",
                "rdzv_backend", "same_network", "main_training_function", "dynamo_config", "fsdp_config",
                "deepspeed_config"):
        assert key in raw, key


def test_reads_accelerate_files_as_they_are(tmp_path):
    seed = tmp_path / "seed.yaml"
    seed.write_text(SEED_YAML)
    cfg = read_config(str(seed))
    assert (cfg["distributed_type"], cfg["num_processes"], cfg["mixed_precision"], cfg["downcast_bf16"]) == \
        ("MULTI_GPU", 2, "fp16", False)
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text(LEGACY_YAML)
    old = read_config(str(legacy))
    assert old["mixed_precision"] == "fp16"  # from `fp16: true`
    assert old["dynamo_config"] == {"dynamo_backend": "NO"} and "num_processes" not in old  # -1 means unset
    assert "fp16" not in old and "ipex_config" not in old
    js = tmp_path / "default_config.yaml"
    js.write_text(ACCELERATE_JSON)
    assert read_config(str(js))["use_cpu"] is True


def test_string_numbers_are_coerced():
    cfg = validate({"num_processes": "8", "main_process_port": "29501", "use_cpu": "yes", "gpu_ids": 0})
    assert (cfg["num_processes"], cfg["main_process_port"], cfg["use_cpu"], cfg["gpu_ids"]) == (8, 29501, True, "0")


def test_seed_yaml_drives_launch_with_cpu_override(tmp_path, capsys):
    seed = tmp_path / "seed.yaml"
    seed.write_text(SEED_YAML)
    (tmp_path / "train.py").write_text("")
    err_code = main(["launch", "--config_file", str(seed), "train.py"])
    assert err_code == 2 and "add --cpu" in capsys.readouterr().err  # MULTI_GPU on a machine without GPUs
    assert main(["launch", "--config_file", str(seed), "--cpu", "--dry_run", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "MULTI_CPU" in out and "HASTEN_MIXED_PRECISION=fp16" in out
    assert f"config file {seed}: main_process_port" in out and ":29500" in out


# -- commands ---------------------------------------------------------------------------------
def test_config_default_writes_yaml_for_this_machine(capsys):
    path = os.environ["HASTEN_CONFIG_FILE"]
    assert main(["config", "default", "--mixed_precision", "bf16"]) == 0
    text = open(path).read()
    assert not text.lstrip().startswith("{")  # YAML, never JSON
    cfg = yaml.safe_load(text)
    assert (cfg["distributed_type"], cfg["num_processes"], cfg["use_cpu"], cfg["mixed_precision"]) == ("NO", 1, True, "bf16")
    assert main(["config", "default"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["config", "default", "--overwrite"]) == 0
    assert yaml.safe_load(open(path))["mixed_precision"] == "no"


def test_config_update_converts_legacy_and_applies_changes(tmp_path, capsys):
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text(LEGACY_YAML)
    assert main(["config", "update", "--config_file", str(legacy), "num_processes=4",
                 "fsdp_config.fsdp_version=2"]) == 0
    raw = yaml.safe_load(legacy.read_text())
    assert "fp16" not in raw and "ipex_config" not in raw and raw["mixed_precision"] == "fp16"
    assert raw["num_processes"] == 4 and raw["fsdp_config"] == {"fsdp_version": 2}
    assert main(["config", "update", "--config_file", str(legacy), "num_proceses=4"]) == 2
    assert "did you mean 'num_processes'" in capsys.readouterr().err


def test_questionnaire_multi_cpu_with_bad_answers_reasked(monkeypatch, capsys, tmp_path):
    path = tmp_path / "q.yaml"
    answer(monkeypatch,
           "7", "2", "1",      # compute environment: out of range, SageMaker (refused), this machine
           "9", "2",           # machine type: bad, multi-CPU
           "1",                # machines
           "x", "4",           # processes: not a number, 4
           "no",               # torch.compile
           "no", "no",         # DeepSpeed, FSDP: offered on CPU processes too
           "2",                # gradient accumulation
           "bf16")             # mixed precision, by name
    assert main(["config", "--config_file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Use DeepSpeed?" in out and "Use FSDP" in out
    assert f"hasten launch --config_file {path} your_script.py" in out  # the file written, not the default
    assert "please answer with a number from 1 to 2" in out and "SageMaker" in out
    assert "'x' is not a whole number" in out
    cfg = read_config(str(path))
    assert (cfg["distributed_type"], cfg["num_processes"], cfg["use_cpu"]) == ("MULTI_CPU", 4, True)
    assert (cfg["gradient_accumulation_steps"], cfg["mixed_precision"]) == (2, "bf16")


def test_questionnaire_multi_machine_gpu_fsdp(monkeypatch, tmp_path):
    path = tmp_path / "q.yaml"
    answer(monkeypatch,
           "", "3",                    # this machine; multi-GPU
           "2", "5", "1",              # 2 machines; rank 5 (too big), 1
           "not an ip!", "10.0.0.1",   # address of machine 0
           "", "c10d", "",             # port 29500, c10d, same network
           "3", "4",                   # processes: 3 is not a multiple of 2 machines; 4
           "0,1,2", "0,1",             # GPU ids: 3 ids for 2 processes per machine; 0,1
           "yes", "", "", "", "",      # torch.compile: inductor, default mode, no fullgraph, no dynamic
           "no", "yes",                # DeepSpeed no, FSDP yes
           "", "", "no", "", "Block", "", "", "no",  # FSDP: v2, reshard, no offload, transformer wrap ...
           "", "fp16")                 # accumulation 1, fp16
    assert main(["config", "--config_file", str(path)]) == 0
    cfg = read_config(str(path))
    assert cfg["distributed_type"] == "FSDP" and cfg["num_machines"] == 2 and cfg["machine_rank"] == 1
    assert (cfg["main_process_ip"], cfg["main_process_port"], cfg["rdzv_backend"]) == ("10.0.0.1", 29500, "c10d")
    assert (cfg["num_processes"], cfg["gpu_ids"], cfg["mixed_precision"]) == (4, "0,1", "fp16")
    assert cfg["dynamo_config"]["dynamo_backend"] == "INDUCTOR"
    assert cfg["fsdp_config"]["fsdp_version"] == 2
    assert cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert cfg["fsdp_config"]["fsdp_offload_params"] is False


def run_questionnaire(path, answers):
    """`hasten config` as a user runs it, the answers typed on stdin; (exit status, what it printed)."""
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "config", "--config_file", str(path)],
                          input="".join(f"{a}\n" for a in answers), capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def test_questionnaire_offers_no_tpu_which_launch_refuses(tmp_path):
    """hasten launch refuses distributed_type XLA, so the machine question lists no TPU (answer 5 is out
    of range and asked again) and nothing asks about TPU downcasting."""
    path = tmp_path / "q.yaml"
    # this machine; "5" (no such choice), then one process; CPU only; no compile; no accumulation; bf16
    rc, out = run_questionnaire(path, ["", "5", "1", "yes", "no", "", "bf16"])
    assert rc == 0, out
    assert "TPU" not in out and "downcast" not in out and "please answer with a number from 1 to 4" in out
    data = yaml.safe_load(path.read_text())
    assert data["distributed_type"] == "NO" and data["downcast_bf16"] == "no"


def test_questionnaire_input_ending_early_is_one_line_error(monkeypatch, capsys, tmp_path):
    answer(monkeypatch, "1")
    assert main(["config", "--config_file", str(tmp_path / "q.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hasten: error: the input ended") and err.strip().count("\n") == 0
    assert not (tmp_path / "q.yaml").exists()


def test_hasten_env_report(capsys):
    write_config(os.environ["HASTEN_CONFIG_FILE"], {"distributed_type": "MULTI_CPU", "num_processes": 2,
                                                    "use_cpu": True})
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for label in ("- hasten:", "- Python:", "- PyTorch:", "- Platform:", "- CPU:", "- RAM:", "- GPUs:",
                  "- Config file:", "distributed_type: MULTI_CPU"):
        assert label in out, label


def test_yaml_written_by_hasten_has_accelerate_layout():
    data = to_yaml_dict(validate(yaml.safe_load(SEED_YAML)))
    assert data["downcast_bf16"] == "no" and data["gpu_ids"] == "all" and data["mixed_precision"] == "fp16"
    assert "gradient_accumulation_steps" not in data  # hasten's own keys only when not default


ACCELERATE_FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: [LlamaDecoderLayer, MLP]
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_fsdp_config_reaches_the_processes(tmp_path, capsys):
    cfg = tmp_path / "fsdp.yaml"
    cfg.write_text(ACCELERATE_FSDP_YAML)
    (tmp_path / "train.py").write_text("")
    assert main(["launch", "--config_file", str(cfg), "--cpu", "--dry_run", "train.py"]) == 0
    out = capsys.readouterr().out
    for line in ("HASTEN_USE_FSDP=true", "FSDP_VERSION=2", "FSDP_RESHARD_AFTER_FORWARD=true",
                 "FSDP_TRANSFORMER_CLS_TO_WRAP=LlamaDecoderLayer,MLP", "FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT",
                 "HASTEN_MIXED_PRECISION=bf16"):
        assert line in out, line
    assert "config file" in out and "distributed_type FSDP" in out
