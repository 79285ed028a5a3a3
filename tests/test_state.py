"""Process state on 1 and 2 real processes."""

import pytest

from devices import process_env, ranks_get_own_gpu
from distributed import check_names, run_checks


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks("checks_state", world_size=2)


@pytest.mark.parametrize("name", check_names("checks_state"))
def test_state_two_processes(two_ranks, name):
    two_ranks.assert_passed(name)


def test_identity_and_split(two_ranks):
    ids = two_ranks.assert_passed("check_identity")
    kind, backend = ("MULTI_GPU", "nccl") if ranks_get_own_gpu(2) else ("MULTI_CPU", "gloo")
    use_cpu = process_env(2).get("HASTEN_USE_CPU")  # the harness applies the device policy (tests/devices.py)
    assert ids == [{"rank": r, "world": 2, "type": kind, "backend": backend, "use_cpu": use_cpu} for r in (0, 1)]
    split = two_ranks.assert_passed("check_split_between_processes")
    assert [s["plain"] for s in split] == [[0, 1, 2], [3, 4]]
    assert [s["padded"] for s in split] == [[0, 1, 2], [3, 4, 4]]
    assert [s["dict"] for s in split] == [{"a": [1, 2], "b": ["x", "y"]}, {"a": [3], "b": ["z"]}]
    assert [s["tensor"] for s in split] == [[0, 1], [2, 2]]
