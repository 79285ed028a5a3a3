"""Defects found by using hasten as scripts do (issue 9): prepare in loops, collectives of tensors
that require grad, saving after ``break``, clipping on accumulation micro-steps. One launch of 1
process and one of 2 processes run every check of ``checks_real_use``."""

import pytest

from distributed import run_checks

MODULE = "checks_real_use"


@pytest.fixture(scope="module")
def one():
    return run_checks(MODULE, world_size=1, timeout=300)


@pytest.fixture(scope="module")
def two():
    return run_checks(MODULE, world_size=2, timeout=300)


@pytest.fixture(params=[1, 2], ids=["1proc", "2proc"])
def report(request):
    return request.getfixturevalue({1: "one", 2: "two"}[request.param])


def test_prepare_in_a_loop_never_returns_another_loaders_twin(report):
    assert report.assert_passed("check_prepare_dataloaders_in_a_loop") == [52] * report.world_size


def test_prepare_in_a_loop_every_kind(report):
    assert report.assert_passed("check_prepare_every_kind_in_a_loop") == [[12, 12, 12, 12]] * report.world_size
