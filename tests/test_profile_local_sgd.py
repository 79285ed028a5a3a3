"""accelerator.profile() and LocalSGD on 2 real processes, and their bad input."""

import pytest

from distributed import run_checks


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks("checks_training_extras", world_size=2)


def test_profile_writes_a_trace_per_rank(two_ranks):
    first, second = two_ranks.assert_passed("check_profile_writes_one_trace_per_rank")
    assert first["events"] == second["events"]  # both ranks read both files
    assert set(first["events"]) == {"0", "1"} and min(first["events"].values()) > 10, first
    assert first["ops"] > 0 and first["leftovers"] == [] and second["leftovers"] == []


def test_profile_schedule_calls_the_handler(two_ranks):
    assert two_ranks.assert_passed("check_profile_schedule_and_handler_override") == [[1], [1]]


def test_local_sgd_agrees_after_each_averaging(two_ranks):
    for value in two_ranks.assert_passed("check_local_sgd_averages_every_k_steps"):
        for step, row in enumerate(value["rows"], start=1):
            if step % 3 == 0:  # averaged: identical everywhere, equal to the mean of the replicas
                assert row["spread"] == 0.0 and row["mean_error"] < 1e-6, (step, row)
            else:  # local steps on different data: the replicas drift apart
                assert row["spread"] > 1e-4, (step, row)
        assert value["end_spread"] == 0.0  # leaving the block averages once more


def test_local_sgd_disabled_is_plain_ddp(two_ranks):
    for value in two_ranks.assert_passed("check_local_sgd_disabled_keeps_ddp_sync"):
        assert all(row["spread"] == 0.0 for row in value["rows"]), value


def test_local_sgd_bad_input(fresh_state):
    from hasten import Accelerator
    from hasten.local_sgd import LocalSGD

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch_model())
    with pytest.raises(ValueError, match="local_sgd_steps=0"):
        LocalSGD(acc, model, local_sgd_steps=0)
    with LocalSGD(acc, model, local_sgd_steps=2) as local_sgd:  # one process: a no-op
        local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 1


def test_profile_kwargs_bad_input():
    from hasten.utils import ProfileKwargs

    with pytest.raises(ValueError, match="'gpu'"):
        ProfileKwargs(activities=["gpu"])
    with pytest.raises(ValueError, match="'steps'"):
        ProfileKwargs(schedule_option={"steps": 1})


def torch_model():
    from torch import nn

    return nn.Linear(2, 1)
