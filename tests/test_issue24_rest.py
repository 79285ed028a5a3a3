"""Issue 24's remaining items: DeepSpeed clipping from clip_grad_norm_ (2 real processes, checks in
checks_issue24_rest.py)."""

import pytest

from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_issue24_rest", world_size=2, timeout=400)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_clip_grad_norm_without_gradient_clipping_clips_through_the_engine(two, stage):
    pytest.importorskip("deepspeed")
    values = two.assert_passed(f"check_zero{stage}_clip_grad_norm_without_gradient_clipping")
    assert values[0]["norms"] == values[1]["norms"]


def test_deepspeed_clipping_follows_each_calls_max_norm(two):
    pytest.importorskip("deepspeed")
    two.assert_passed("check_zero2_clip_follows_each_call")


def test_a_save_hook_failing_on_one_process_cannot_leave_another_in_a_collective(two):
    values = two.assert_passed("check_save_hook_failing_on_one_process_is_agreed_before_a_collective_hook")
    assert values[0]["message"] == values[1]["message"]
