"""The public API on 2 real processes: see checks_api.py. One launch for the module."""

import pytest

from devices import multi_process_type
from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_api", world_size=2, timeout=300)


def test_copy_tensor_to_devices_from_one_owner(two):
    errors = two.assert_passed("check_copy_tensor_to_devices")
    assert errors[0] == errors[1] and len(errors[0]) == 2  # both processes raise the same error
    assert "every process passed None" in errors[0][0]
    assert "processes [0, 1] each passed one" in errors[0][1]


def test_decorators_run_on_the_named_processes(two):
    (ran0, answer0), (ran1, answer1) = two.assert_passed("check_decorators")
    assert ran0 == ["main", "main()", "local", "l0"] and answer0 == 42
    assert ran1 == ["last", "p1"] and answer1 is None


def test_synchronize_rng_states_top_level(two):
    draws = two.assert_passed("check_rng_states_from_top_level_name")
    assert draws[0] == draws[1]


def test_state_objects_created_again_see_the_same_processes(two):
    kind = multi_process_type(2)
    assert two.assert_passed("check_state_objects_can_be_created_again") == [[2, 0, 0, kind], [2, 1, 1, kind]]


def test_no_sync_keeps_gradients_local_then_syncs(two):
    assert two.assert_passed("check_no_sync_keeps_gradients_local") == [True, True]


def test_regional_compilation_under_ddp_matches_one_process(two):
    two.assert_passed("check_regional_compilation_under_ddp")


def test_compile_with_bf16_under_ddp_matches_one_process(two):
    two.assert_passed("check_compile_with_bf16_under_ddp")


def test_save_and_load_state_with_a_folder_per_process(two):
    assert two.assert_passed("check_save_and_load_state_with_a_folder_per_process") == [[True, True], [True, True]]


def test_every_loader_shape_yields_each_sample_once(two):
    for seen in two.assert_passed("check_every_loader_shape_yields_each_sample_once"):
        assert seen == {name: list(range(22)) for name in seen} and len(seen) == 4
