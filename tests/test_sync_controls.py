"""trigger_sync_in_backward and join_uneven_inputs with 2 real processes (Accelerate's semantics)."""

import pytest

from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_sync_controls", world_size=2)


def test_trigger_sync_in_backward_is_a_context_manager_that_restores_no_sync(two):
    two.assert_passed("check_trigger_sync_in_backward_is_a_context_manager")


def test_join_uneven_inputs_warns_for_iterable_loaders_and_other_strategies(two):
    for one in two.assert_passed("check_join_uneven_inputs_warns_instead_of_failing"):
        assert one["iterable warned"] and one["other strategy warned"], one
    seen = two.assert_passed("check_join_uneven_inputs_warns_instead_of_failing")
    # Map-style and dispatched iterable loaders take the override inside the block only.
    assert [s["before"] for s in seen] == [[3, 3], [3, 3]] and [s["after"] for s in seen] == [[3, 3], [3, 3]], seen
    assert [s["inside"] for s in seen] == [[3, 3], [2, 2]], seen
