"""`hasten to-fsdp2`: the same conversion as `accelerate to-fsdp2`, torch-free, one-line errors."""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from hasten.commands.cli import main
from hasten.commands.config_schema import read_config, write_config

FSDP1 = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
    "num_processes": 2, "num_machines": 1,
    "fsdp_config": {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_cpu_ram_efficient_loading": True, "fsdp_forward_prefetch": False, "fsdp_offload_params": False,
        "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_sync_module_states": True, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_use_orig_params": True, "fsdp_activation_checkpointing": True, "fsdp_version": 1,
    },
}


def _write(path, data):
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return str(path)


def _load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def _accelerate(*args):
    exe = shutil.which("accelerate")
    if exe is None:
        pytest.skip("the accelerate command is not installed (test extra)")
    out = subprocess.run([exe, "to-fsdp2", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def _by_hand(tmp_path):
    return _write(tmp_path / "fsdp1.yaml", FSDP1)


def _by_hasten_config(tmp_path):
    fsdp = {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_offload_params": True, "fsdp_use_orig_params": False}
    return write_config(str(tmp_path / "hasten.yaml"), {"distributed_type": "FSDP", "num_processes": 2,
                                                         "fsdp_config": fsdp})


@pytest.mark.parametrize("make", [_by_hand, _by_hasten_config], ids=["by_hand", "hasten_config"])
def test_same_result_as_accelerate(tmp_path, capsys, make):
    source = make(tmp_path)
    ours, theirs = tmp_path / "ours.yaml", tmp_path / "theirs.yaml"
    assert main(["to-fsdp2", "--config_file", source, "--output_file", str(ours)]) == 0
    notes = capsys.readouterr().err
    assert "fsdp_backward_prefetch is dropped" in notes
    _accelerate("--config_file", source, "--output_file", str(theirs))
    assert _load(ours) == _load(theirs)
    converted = _load(ours)["fsdp_config"]
    assert converted["fsdp_version"] == 2 and "fsdp_sharding_strategy" not in converted
    assert not {"fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states"} & set(converted)
    read_config(str(ours))  # hasten launch reads the result


def test_values_of_each_strategy(tmp_path, capsys):
    expected = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False,
                "NO_SHARD": False, 2: False, 1: True}
    for strategy, reshard in expected.items():
        source = _write(tmp_path / "in.yaml", {"distributed_type": "FSDP",
                                               "fsdp_config": {"fsdp_sharding_strategy": strategy}})
        assert main(["to-fsdp2", "--config_file", source, "--output_file", str(tmp_path / "out.yaml"),
                     "--overwrite"]) == 0
        assert _load(tmp_path / "out.yaml")["fsdp_config"] == {"fsdp_reshard_after_forward": reshard,
                                                                "fsdp_version": 2}, strategy
    assert "hybrid sharding" in capsys.readouterr().err


def test_overwrite_in_place_and_unchanged_cases(tmp_path, capsys):
    source = _by_hand(tmp_path)
    assert main(["to-fsdp2", "--config_file", source, "--overwrite"]) == 0
    assert _load(source)["fsdp_config"]["fsdp_version"] == 2
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temp file left
    again = tmp_path / "again.yaml"
    assert main(["to-fsdp2", "--config_file", source, "--output_file", str(again)]) == 0
    assert _load(again) == _load(source)
    assert "Config already specifies FSDP2, skipping conversion..." in capsys.readouterr().err
    plain = _write(tmp_path / "ddp.yaml", {"distributed_type": "MULTI_GPU", "num_processes": 2})
    assert main(["to-fsdp2", "--config_file", plain, "--output_file", str(tmp_path / "ddp2.yaml")]) == 0
    assert _load(tmp_path / "ddp2.yaml") == _load(plain)


@pytest.mark.parametrize("case, words", [
    ("no_output", "needs --output_file PATH, or --overwrite"),
    ("missing", "does not exist"),
    ("exists", "already exists; pass --overwrite"),
    ("empty", "is empty"),
    ("not_yaml", "is not valid YAML at line"),
    ("list", "holds a list, not a mapping"),
    ("section", "fsdp_config must be a mapping"),
    ("strategy", "'HALF_SHARD' is not an FSDP sharding strategy"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case, words):
    good = _by_hand(tmp_path)
    out = str(tmp_path / "out.yaml")
    contents = {"empty": "", "not_yaml": "a: [1,\n", "list": "- 1\n- 2\n", "section": "fsdp_config: 3\n",
                "strategy": "fsdp_config:\n  fsdp_sharding_strategy: HALF_SHARD\n"}
    if case in contents:
        good = str(tmp_path / f"{case}.yaml")
        with open(good, "w") as f:
            f.write(contents[case])
    argv = ["to-fsdp2", "--config_file", good, "--output_file", out]
    if case == "no_output":
        argv = argv[:3]
    elif case == "missing":
        argv[2] = str(tmp_path / "nope.yaml")
    elif case == "exists":
        _write(out, {"keep": 1})
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hasten: error: ") and words in err and "\n" not in err, err
    if case == "exists":
        assert _load(out) == {"keep": 1}
    elif case != "no_output":
        assert not os.path.exists(out)


def test_help_does_not_import_torch():
    code = ("import sys\nfrom hasten.commands.cli import main\ntry:\n    main(['to-fsdp2', '--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\nelse:\n    raise AssertionError('no help')\n"
            "assert 'torch' not in sys.modules\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
    assert "--output_file" in out.stdout and "--overwrite" in out.stdout
