"""DeepSpeedPlugin in one process, without DeepSpeed: fields, environment, JSON files (no engine is built)."""

import json

import pytest

from hasten.utils.deepspeed_plugin import DeepSpeedPlugin


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if "DEEPSPEED" in name or name.endswith(("GRADIENT_CLIPPING", "GRADIENT_ACCUMULATION_STEPS")):
            monkeypatch.delenv(name)


def test_defaults_match_accelerate():
    plugin = DeepSpeedPlugin()
    cfg = plugin.deepspeed_config
    assert plugin.zero_stage == 2 and cfg["zero_optimization"]["stage"] == 2
    assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["gradient_accumulation_steps"] == "auto"
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert plugin.zero3_init_flag is False and plugin.zero3_save_16bit_model is False


@pytest.mark.parametrize("prefix", ["HASTEN_", "ACCELERATE_"])
def test_launcher_environment_is_read(monkeypatch, prefix):
    """What `hasten launch --use_deepspeed --zero_stage 3 --offload_optimizer_device cpu ...` sets."""
    monkeypatch.setenv(prefix + "DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv(prefix + "DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    monkeypatch.setenv(prefix + "GRADIENT_CLIPPING", "0.5")
    monkeypatch.setenv(prefix + "DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert plugin.deepspeed_config["gradient_clipping"] == 0.5 and zero["stage3_gather_16bit_weights_on_model_save"]


def test_launcher_config_file_from_environment(monkeypatch, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"}))
    monkeypatch.setenv("HASTEN_DEEPSPEED_CONFIG_FILE", str(path))
    monkeypatch.setenv("HASTEN_DEEPSPEED_ZERO_STAGE", "3")  # a file wins over the launcher's other flags
    plugin = DeepSpeedPlugin(gradient_clipping=0.3)  # given outright: fills the file's "auto"
    assert plugin.zero_stage == 1 and plugin.deepspeed_config["gradient_clipping"] == 0.3


def test_explicit_field_contradicting_the_file_is_one_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}))
    with pytest.raises(ValueError) as info:
        DeepSpeedPlugin(hf_ds_config=str(path), gradient_clipping=0.3)
    assert "gradient_clipping=1.0" in str(info.value) and "0.3" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"zero_stage": "two"}, ["zero_stage='two'"]),
    ({"offload_optimizer_device": "gpu"}, ["'gpu'", "none, cpu, nvme"]),
    ({"offload_optimizer_device": "nvme"}, ["nvme_path"]),
    ({"zero3_init_flag": "maybe"}, ["zero3_init_flag='maybe'"]),
    ({"hf_ds_config": 3}, ["neither a path nor a dict"]),
])
def test_bad_fields_name_the_value(kwargs, words):
    with pytest.raises(ValueError) as info:
        DeepSpeedPlugin(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_json_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        DeepSpeedPlugin(hf_ds_config=str(path))


def test_import_stays_torch_free():
    import subprocess
    import sys

    code = "import sys, hasten.utils.deepspeed_plugin, hasten.utils.deepspeed; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
