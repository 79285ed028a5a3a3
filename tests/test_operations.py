"""Collectives on nested structures, RNG seeding and syncing: real processes (gloo, or NCCL with a GPU each).

Three launches in all: 2 ranks, 1 rank, and 2 ranks in debug mode (HASTEN_DEBUG=1).
"""

import pytest

from devices import ranks_get_own_gpu
from distributed import check_names, run_checks

MODULE = "checks_operations"
_ALL = check_names(MODULE)
DEBUG_CHECKS = [n for n in _ALL if n.startswith("check_debug_")]
PLAIN_CHECKS = [n for n in _ALL if n not in DEBUG_CHECKS]
_NO_DEBUG = {"HASTEN_DEBUG": "0", "ACCELERATE_DEBUG_MODE": "0"}
ON = "on cuda" if ranks_get_own_gpu(2) else "on cpu"  # where the debug launch's tensors live


@pytest.fixture(scope="module")
def two():
    return run_checks(MODULE, world_size=2, env=_NO_DEBUG, only=PLAIN_CHECKS, timeout=180)


@pytest.fixture(scope="module")
def one():
    return run_checks(MODULE, world_size=1, env=_NO_DEBUG, only=PLAIN_CHECKS, timeout=180)


@pytest.fixture(scope="module")
def debug():
    # A mismatch must raise on every rank rather than hang: the timeout bounds the whole launch.
    return run_checks(MODULE, world_size=2, env={"HASTEN_DEBUG": "1"}, only=DEBUG_CHECKS, timeout=120)


@pytest.fixture(params=[1, 2], ids=["1proc", "2proc"])
def report(request):
    return request.getfixturevalue({1: "one", 2: "two"}[request.param])


# -- gather -----------------------------------------------------------------------------------------
def test_gather_nested_exact_values(report):
    values = report.assert_passed("check_gather_nested")
    matrix = lambda r: [[100 * r + 0.0, 100 * r + 2.0, 100 * r + 4.0], [100 * r + 1.0, 100 * r + 3.0, 100 * r + 5.0]]
    if report.world_size == 2:
        expected = {
            "a": [[0.0, 0.5], [1.0, 1.5]], "b0": [0, 1, 2, 10, 11, 12], "scalar": [0, 1], "scalar_shape": [2],
            "px": [0, 0, 1, 1], "py": [True, True, True, False], "m": matrix(0) + matrix(1),
            "extra_object_collectives": 0,
        }
    else:  # one process: the input comes back as is (a 0-dim tensor stays 0-dim)
        expected = {
            "a": [[0.0, 0.5]], "b0": [0, 1, 2], "scalar": 0, "scalar_shape": [], "px": [0, 0], "py": [True, True],
            "m": matrix(0), "extra_object_collectives": 0,
        }
    assert values == [expected] * report.world_size


def test_gather_object(report):
    values = report.assert_passed("check_gather_object")
    if report.world_size == 2:
        expected = {"listed": ["r0", {"rank": 0}, "r1", {"rank": 1}], "single": [{"rank": 0}, {"rank": 1}]}
    else:
        expected = {"listed": ["r0", {"rank": 0}], "single": {"rank": 0}}
    assert values == [expected] * report.world_size


def test_gather_rejects_non_tensors(two):
    for message in two.assert_passed("check_gather_rejects_non_tensors"):
        assert "str" in message and "input['bad']" in message and "gather_object" in message


# -- broadcast --------------------------------------------------------------------------------------
def test_broadcast_tensors_and_objects(report):
    src = report.world_size - 1
    expected = {"x": [[float(src)] * 3] * 2, "y": [src, src + 1], "objects": ["from 0", {"rank": 0}]}
    assert report.assert_passed("check_broadcast") == [expected] * report.world_size


def test_broadcast_bad_source_names_the_choices(two):
    for message in two.assert_passed("check_broadcast_bad_source"):
        assert "from_process=5" in message and "0..1" in message


# -- reduce -----------------------------------------------------------------------------------------
def test_reduce_each_mode(report):
    values = report.assert_passed("check_reduce_modes")
    if report.world_size == 2:
        exact = {
            "sum": [3.0, 30.0], "mean": [1.5, 15.0], "max": [2.0, 20.0], "min": [1.0, 10.0],
            "default": [1.5], "scaled_sum": [6.0], "int_mean": [[1.5], "torch.float32"], "int_sum": [[3], "torch.int64"],
        }
    else:
        exact = {
            "sum": [1.0, 10.0], "mean": [1.0, 10.0], "max": [1.0, 10.0], "min": [1.0, 10.0],
            "default": [1.0], "scaled_sum": [2.0], "int_mean": [[1.0], "torch.float32"], "int_sum": [[1], "torch.int64"],
        }
    for rank, value in enumerate(values):
        assert {k: value[k] for k in exact} == exact
        assert value["none"] == [1.0 + rank, 10.0 * (rank + 1)]  # no communication: this rank's own values
        assert "'avg'" in value["bad_mode"] and "'mean'" in value["bad_mode"] and "'min'" in value["bad_mode"]
        assert "float" in value["bad_type"] and "input['x'][1]" in value["bad_type"]


# -- pad_across_processes ---------------------------------------------------------------------------
def test_pad_across_processes(report):
    values = report.assert_passed("check_pad_across_processes")
    if report.world_size == 1:
        assert values[0] == {
            "last": [[1.0, 1.0]] * 2, "more": [[1.0, 1.0]], "first": [[1.0, 1.0]] * 2, "by_col": [[1]],
            "negative": [[1]], "gathered_shape": [2, 2],
        }
        return
    rank0, rank1 = values
    assert rank0["last"] == [[1.0, 1.0]] * 2 + [[-1.0, -1.0]] * 2
    assert rank0["first"] == [[-1.0, -1.0]] * 2 + [[1.0, 1.0]] * 2
    assert rank1["last"] == rank1["first"] == [[2.0, 2.0]] * 4
    assert rank0["more"] == [[1.0, 1.0]] and rank1["more"] == [[2.0, 2.0]]  # same size everywhere: unchanged
    assert rank0["by_col"] == [[1, 7]] and rank1["by_col"] == [[2, 2]]
    assert rank0["negative"] == [[1, 0]] and rank1["negative"] == [[2, 2]]
    assert rank0["gathered_shape"] == rank1["gathered_shape"] == [8, 2]


def test_send_to_device_nested(one):
    assert one.assert_passed("check_send_to_device") == ["ok"]


def test_no_extra_collective_without_debug(two):
    assert two.assert_passed("check_no_extra_collective_without_debug") == [0, 0]


# -- random -----------------------------------------------------------------------------------------
def test_set_seed_device_specific(report):
    values = report.assert_passed("check_set_seed")
    for value in values:
        assert value["shared"] == [value["again"]] * report.world_size  # same seed: same stream everywhere
        if report.world_size == 2:
            first, second = value["specific"]
            for a, b in zip(first, second):  # torch, random and numpy all differ per rank
                assert a != b
            assert value["specific"][0] == value["shared"][0]  # rank 0 adds 0 to the seed
    assert values[0] == values[-1]


def test_synchronize_rng_states(report):
    values = report.assert_passed("check_synchronize_rng_states")
    for value in values:
        assert value["everyone"] == [value["rank0_own"]] * report.world_size
        assert "'bogus'" in value["errors"][0] and "generator" in value["errors"][0]
        assert "generator=" in value["errors"][1]
        if len(value["errors"]) > 2:
            assert "'cuda'" in value["errors"][2]


# -- debug mode -------------------------------------------------------------------------------------
def test_debug_shape_mismatch_names_every_rank(debug):
    for message in debug.assert_passed("check_debug_shape_mismatch"):
        assert "gather" in message
        assert f"process 0: gather({{'x': float32[2, 3] {ON}}})" in message
        assert f"process 1: gather({{'x': float32[3, 3] {ON}}})" in message
        assert "pad_across_processes" in message  # the fix


def test_debug_different_operations(debug):
    for message in debug.assert_passed("check_debug_different_operations"):
        assert "different collective operations" in message
        assert f"process 0: gather(float32[2] {ON})" in message
        assert f"process 1: reduce(float32[2] {ON}, reduction='sum')" in message


def test_debug_other_mismatches(debug):
    for value in debug.assert_passed("check_debug_other_mismatches"):
        assert "reduction='sum'" in value["reduce_mode"] and "reduction='max'" in value["reduce_mode"]
        assert "from_process=0" in value["broadcast_source"] and "from_process=1" in value["broadcast_source"]
        assert f"{{'a': float32[2] {ON}}}" in value["structure"] and f"{{'b': float32[2] {ON}}}" in value["structure"]
        assert "float32[2]" in value["dtype"] and "float64[2]" in value["dtype"]
        assert f"process 0: pad_across_processes(float32[2] {ON}, dim=0)" in value["pad_ndim"]
        assert f"process 1: pad_across_processes(float32[2, 2] {ON}, dim=0)" in value["pad_ndim"]
        assert "gather_object()" in value["object_vs_tensor"] and f"gather(float32[1] {ON})" in value["object_vs_tensor"]


def test_debug_matching_calls_work(debug):
    rank0, rank1 = debug.assert_passed("check_debug_matching_calls_work")
    assert rank0["gathered"] == rank1["gathered"] == [0, 1]
    assert rank0["summed"] == rank1["summed"] == [3.0]
    assert rank0["padded"] == [[1.0, 1.0], [0.0, 0.0]] and rank1["padded"] == [[1.0, 1.0]] * 2
    assert rank0["sent"] == rank1["sent"] == [1]
    assert rank0["objects"] == rank1["objects"] == [0, 1]
    assert rank0["by_col"] == [[[1.0, 0.0]], [1.0] * 3] and rank1["by_col"] == [[[1.0, 1.0]], [1.0] * 4]
    assert rank0["object_collectives"] == rank1["object_collectives"] == 7  # 6 checks + gather_object's own


def test_logger_in_order_and_main_process_only(two):
    lines = two.assert_passed("check_logger_in_order")[0]
    assert lines[:2] == ["[RANK 0] ordered", "[RANK 1] ordered"]
    assert sorted(lines[2:]) == ["[RANK 0] everyone", "[RANK 0] main only", "[RANK 1] everyone"]


def test_logger_single_process_has_no_rank_prefix(one):
    assert one.assert_passed("check_logger_in_order") == [["ordered", "main only", "everyone"]]
