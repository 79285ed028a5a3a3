"""fp8 settings on the command line: launch flags and environment, config keys, the questionnaire,
and a real `hasten launch` of an fp8 script on 2 processes."""

import io
import os

import pytest
import yaml

from hasten.commands.cli import build_parser, main
from hasten.commands.config_schema import read_config
from hasten.commands.launch import build_plan
from scripts.launch_common import clean_env, hasten, ranks, script
from test_cli import clean  # noqa: F401  (autouse: no launcher variables, no config file, cwd in tmp)


def child_env(*argv):
    args = build_parser().parse_args(["launch", *argv, "train.py"])
    return {k: v for k, v in build_plan(args, os.environ).child_env.items() if "FP8" in k}


def test_fp8_flags_become_hasten_fp8_variables_only_with_fp8():
    env = child_env("--mixed_precision", "fp8", "--fp8_backend", "te", "--fp8_format", "e4m3", "--fp8_margin", "2",
                    "--fp8_override_linear_precision", "false,false,true", "--fp8_use_autocast_during_eval",
                    "--fp8_opt_level", "O1", "--fp8_pad_inner_dim", "no")
    assert env == {"HASTEN_FP8_BACKEND": "TE", "HASTEN_FP8_FORMAT": "E4M3", "HASTEN_FP8_MARGIN": "2",
                   "HASTEN_FP8_OVERRIDE_LINEAR_PRECISION": "false,false,true",
                   "HASTEN_FP8_USE_AUTOCAST_DURING_EVAL": "true", "HASTEN_FP8_OPT_LEVEL": "O1",
                   "HASTEN_FP8_PAD_INNER_DIM": "false"}
    assert child_env("--mixed_precision", "bf16", "--fp8_backend", "ao") == {}
    assert child_env("--mixed_precision", "fp8") == {}  # unset settings keep the library's defaults


def test_fp8_settings_from_accelerate_environment_and_config(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "msamp")
    assert child_env("--mixed_precision", "fp8")["HASTEN_FP8_BACKEND"] == "MSAMP"
    monkeypatch.delenv("ACCELERATE_FP8_BACKEND")
    # What Accelerate's questionnaire writes, legacy spellings included.
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({
        "mixed_precision": "fp8", "fp8_config": {"backend": "TE", "amax_history_length": 16,
                                                 "amax_compute_algorithm": "max", "fp8_format": "HYBRID",
                                                 "override_linear_precision": [False, True, False],
                                                 "optimization_level": "O2"}}))
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path / "cfg.yaml"))
    assert read_config(str(tmp_path / "cfg.yaml"))["fp8_config"]["amax_history_len"] == 16
    env = child_env()
    assert env["HASTEN_FP8_AMAX_HISTORY_LEN"] == "16" and env["HASTEN_FP8_AMAX_COMPUTE_ALGO"] == "max"
    assert env["HASTEN_FP8_OVERRIDE_LINEAR_PRECISION"].lower() == "false,true,false"
    assert env["HASTEN_FP8_OPT_LEVEL"] == "O2"


def test_bad_fp8_config_key_is_one_line_error(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text("mixed_precision: fp8\nfp8_config:\n  backend: fp4\n")
    assert main(["launch", "--config_file", str(tmp_path / "cfg.yaml"), "train.py"]) == 2
    err = capsys.readouterr().err
    assert "fp8_config.backend: 'fp4' is not one of AO, TE, MSAMP" in err and err.strip().count("\n") == 0


def test_questionnaire_asks_the_fp8_backend(monkeypatch, tmp_path):
    path = tmp_path / "q.yaml"
    answers = ["", "1", "yes", "no", "", "fp8", "", "no"]  # machine, 1 proc on CPU, no compile, fp8: ao, no pad
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{a}\n" for a in answers)))
    assert main(["config", "--config_file", str(path)]) == 0
    cfg = read_config(str(path))
    assert cfg["mixed_precision"] == "fp8" and cfg["fp8_config"] == {"backend": "AO", "pad_inner_dim": False}


def test_hasten_launch_trains_fp8_on_two_processes(tmp_path):
    pytest.importorskip("torchao")
    env = clean_env(tmp_path / "absent.yaml", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    rc, out, err, _ = hasten(["launch", "--cpu", "--num_processes", "2", "--mixed_precision", "fp8",
                              "--fp8_backend", "ao", "--fp8_pad_inner_dim", "false", script("launch_fp8.py"),
                              tmp_path], env, timeout=300)
    assert rc == 0, err[-3000:]
    reports = ranks(tmp_path, 2)
    for report in reports:
        assert report["precision"] == "fp8" and report["backend"] == "AO" and report["pad_inner_dim"] is False
        assert report["layers"] == ["Linear", "Float8Linear", "Linear"]
    assert reports[0]["weight_sum"] == reports[1]["weight_sum"]  # DDP kept the ranks in step
    assert "Failed to load" not in err  # torchao's CPU import noise is kept out of the log
    assert reports[0]["float8_all_gather"] == ["Parameter", "Parameter"]  # no all-gather wrapper without FSDP2


def test_hasten_launch_trains_fp8_with_fsdp(tmp_path):
    pytest.importorskip("torchao")
    env = clean_env(tmp_path / "absent.yaml", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    rc, out, err, _ = hasten(["launch", "--cpu", "--num_processes", "2", "--mixed_precision", "fp8", "--use_fsdp",
                              "--fp8_backend", "ao", "--fp8_enable_fsdp_float8_all_gather", "true",
                              script("launch_fp8.py"), tmp_path], env, timeout=300)
    assert rc == 0, err[-3000:]
    reports = ranks(tmp_path, 2)
    for report in reports:
        assert report["precision"] == "fp8" and report["distributed_type"] == "FSDP"
        assert report["layers"] == ["Linear", "Float8Linear", "Linear"]
        assert report["float8_all_gather"] == ["WeightWithDynamicFloat8CastTensor", "Tensor"], report
    weight_sum = reports[0]["weight_sum"]
    assert reports[1]["weight_sum"] is None and weight_sum is not None and weight_sum == weight_sum  # not NaN
