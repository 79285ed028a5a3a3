"""FSDP2 keeps a trained model's root parameters gathered from its forward to its backward (torch's own choice
for a root), instead of freeing and re-gathering them (an embedding and an output head: the largest tensors)
around every forward; after a forward without gradients (evaluation, a frozen model) the root is freed, so
``parameters()`` are the shards again. 2 real processes (checks in checks_fsdp2_root.py)."""

import pytest

from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_fsdp2_root", world_size=2, timeout=300)


def test_trained_root_stays_gathered_until_backward_and_is_freed_after_no_grad(two):
    for seen in two.assert_passed("check_trained_root_stays_gathered_until_backward_frozen_root_is_freed"):
        for step in seen:
            assert list(step["trained"]) == [True, True, False], step  # gathered for the backward
            assert list(step["evaluated"]) == [False, False, False], step  # no_grad: freed
            assert list(step["frozen"]) == [False, False, False], step
            assert list(step["trained_after_step"]) == [False, False, False], step
            assert step["loss"] == step["loss"]  # a number, not nan
