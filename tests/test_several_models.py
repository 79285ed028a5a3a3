"""Several models in one job (a trained model beside a frozen one) on 2 real processes over gloo,
under DDP, FSDP2 and DeepSpeed ZeRO-2/3: checks in checks_several_models.py, one launch for all."""

import importlib.util

import pytest

from distributed import check_names, run_checks

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
CHECKS = [n for n in check_names("checks_several_models") if HAS_DEEPSPEED or "_ds" not in n and "deepspeed" not in n]


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_several_models", world_size=2, only=CHECKS)


@pytest.mark.parametrize("name", [n for n in CHECKS if "_ds_" not in n and "deepspeed" not in n])
def test_ddp_and_fsdp2(two, name):
    values = two.assert_passed(name)
    assert values[0] == values[1]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("name", [n for n in check_names("checks_several_models") if "_ds_" in n or "deepspeed" in n])
def test_deepspeed(two, name):
    values = two.assert_passed(name)
    assert values[0] == values[1]


def test_example_dpo_through_launcher(tmp_path):
    """examples/several_models.py (policy + frozen reference, DPO) on 2 CPU processes: it learns the
    preference, and save_state holds both models."""
    import json
    import os
    import re
    import subprocess
    import sys

    pytest.importorskip("transformers")
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "several_models.py")
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", "2",
                          example, "--epochs", "1", "--output_dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    rows = re.findall(r"epoch \d+: preference accuracy ([\d.]+) mean margin ([-\d.]+) \((\d+) pairs, (\d+) process",
                      out.stdout)
    assert len(rows) == 1, out.stdout + out.stderr
    assert all(int(pairs) == 512 and int(procs) == 2 for _, _, pairs, procs in rows)
    assert float(rows[0][0]) > 0.9 and float(rows[0][1]) > 0, rows  # the policy learnt to prefer the chosen
    with open(tmp_path / "state" / "manifest.json") as f:
        assert len(json.load(f)["contents"]["models"]) == 2
    assert (tmp_path / "policy" / "model.safetensors").exists()


@pytest.mark.parametrize("plugins, words", [
    ({}, ["deepspeed_plugins={}"]),
    ({"student": object()}, ["deepspeed_plugins['student']", "DeepSpeedPlugin"]),
    ({1: None}, ["1", "string"]),
])
def test_bad_deepspeed_plugins(fresh_state, plugins, words):
    from hasten import Accelerator

    with pytest.raises((ValueError, TypeError)) as err:
        Accelerator(cpu=True, deepspeed_plugins=plugins)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_select_without_deepspeed_names_the_fix(fresh_state):
    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="deepspeed_plugins"):
        acc.state.select_deepspeed_plugin("teacher")


def test_plugin_selected_only_through_the_state():
    from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2)
    with pytest.raises(ValueError, match="select_deepspeed_plugin"):
        plugin.select()
    with pytest.raises(NotImplementedError):
        plugin.selected = True
    assert not plugin.selected
