"""Save and load pre-hooks get the models as Accelerate hands them: on several processes the module
that DistributedDataParallel wraps, not the wrapper (Accelerate's registry keeps the module it was
given). diffusers' training examples call ``model.save_pretrained`` and ``model.load_state_dict`` in
their hooks and check ``isinstance(model, type(unwrap_model(unet)))``; with the wrapper every one of
them failed on 2 processes (tools/diffusers_result.md)."""

import pytest
from distributed import run_checks


@pytest.fixture(scope="module")
def report():
    return run_checks("checks_hook_models", world_size=2)


def test_hooks_see_the_modules_ddp_wraps(report):
    for value in report.assert_passed("check_hooks_see_the_modules_ddp_wraps"):
        assert value["prepared"] == "DistributedDataParallel"  # the script still gets the wrapper
        assert value["seen"] == {"save": ["Net"], "load": ["Net"]}
        assert value["restored"]
