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
