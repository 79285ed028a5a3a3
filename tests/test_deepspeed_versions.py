"""A changed private DeepSpeed interface is one clear error naming DeepSpeed's version (checks run on one
process: checks_deepspeed_versions.py)."""

import pytest

from distributed import run_checks

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def one():
    return run_checks("checks_deepspeed_versions", world_size=1)


def _version_error(message, *words):
    from importlib.metadata import version

    assert message is not None, "no error: the changed interface was used"
    assert "DeepSpeedVersionError" in message and f"deepspeed {version('deepspeed')}" in message, message
    assert "damaged" not in message.split("(nothing was loaded and the checkpoint is not judged damaged)")[0], message
    for word in words:
        assert word in message, (word, message)


def test_zero_to_fp32_changes_are_version_errors(one):
    (got,) = one.assert_passed("check_zero_to_fp32_changes_are_version_errors")
    _version_error(got["signature"], "_get_fp32_state_dict_from_zero2_checkpoint")
    _version_error(got["load_state"], "_get_fp32_state_dict_from_zero2_checkpoint")
    _version_error(got["missing"], "zero_model_state")
    assert got["restored"] == ["bias", "weight"], got


def test_checkpoint_engine_changes_are_version_errors(one):
    (got,) = one.assert_passed("check_checkpoint_engine_changes_are_version_errors")
    _version_error(got["load signature"], "CheckpointEngine.load(path, map_location)", "weights_only")
    _version_error(got["no checkpoint_engine"], "checkpoint_engine")
    assert got["loads after"] is None, got


def test_gradient_clipping_change_is_a_version_error(one):
    (got,) = one.assert_passed("check_gradient_clipping_change_is_a_version_error")
    _version_error(got["error"], "gradient_clipping")
