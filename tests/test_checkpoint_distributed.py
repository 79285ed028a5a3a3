"""save_state / load_state across 2 real processes: who writes what, agreement on errors."""

import pytest
from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_checkpoint", world_size=2)


def test_every_process_writes_only_its_own_files(two):
    values = two.assert_passed("check_every_process_writes_only_its_own_files")
    assert values[0] == values[1]
    writers = values[0]["writers"]
    assert writers == {"model.safetensors": 0, "optimizer.safetensors": 0, "rank_0.safetensors": 0,
                       "rank_1.safetensors": 1}
    assert values[0]["world"] == 2 and values[0]["hook_folder"] == ".checkpoint_0"


def test_a_problem_on_one_process_stops_every_process_before_any_change(two):
    for value in two.assert_passed("check_every_process_refuses_a_corrupt_file_of_another"):
        assert value == {"error": True, "untouched": True}
    assert two.assert_passed("check_every_process_refuses_when_one_process_differs") == [True, True]


def test_retention_and_numbering_with_two_processes(two):
    for value in two.assert_passed("check_retention_and_numbering"):
        assert value == {"names": ["checkpoint_0", "checkpoint_1", "checkpoint_2"], "left": ["checkpoint_2"]}


def test_save_on_each_node_on_one_machine(two):
    assert two.assert_passed("check_save_on_each_node_on_one_machine") == [True, True]


def test_a_rank_file_missing_from_the_manifest_gives_an_error_naming_checkpoint_and_file(two):
    for message in two.assert_passed("check_a_rank_file_missing_from_the_manifest_is_named"):
        assert message is not None, "the load went through"
        assert "checkpoint_0' lacks 'rank_1.safetensors'" in message and "process 1:" in message, message


def test_a_manifest_only_process_0_can_read_stops_every_process(two):
    for message in two.assert_passed("check_resume_from_a_damaged_manifest_raises_on_every_process"):
        assert message is not None and message.startswith("resume=") and "manifest.json" in message and "damaged" in message, message


def test_background_saves_share_one_group_and_the_end_of_the_script_destroys_it(two):
    for value in two.assert_passed("check_background_saves_share_one_group_released_at_the_end"):
        assert value == {"shared": True, "grown": 1, "left": 0, "saved": ["checkpoint_0"]}, value
