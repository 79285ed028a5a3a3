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


def test_collectives_accept_tensors_that_require_grad(report):
    values = report.assert_passed("check_collectives_accept_tensors_that_require_grad")
    n = report.world_size
    means = [(0 + 1) / 2, (2 + 3) / 2, (4 + 5) / 2, 6.0]  # the batches of range(7) by 2
    expected = {
        "gather": [float(r + 1) for r in range(n) for _ in range(3)],
        "gather_leaf": [1.0] * 3 * n,
        "gather_nested": [float(r + 1) for r in range(n) for _ in range(3)],
        "reduce": [float(sum(range(1, n + 1)))] * 3,
        "reduce_leaf": [1.0] * 3,
        "gather_object": [[float(r + 1)] * 3 for r in range(n)],
        "broadcast_leaf": [[0.0] * 3] * 2,
        "broadcast": [float(n)] * 3,
        "gather_for_metrics": [3 * m for m, size in zip(means, (2, 2, 2, 1)) for _ in range(size)],
        "gather_for_metrics_padded": ([[0.0, 3.0, 6.0, 9.0], [12.0]] if n == 2 else [[0.0, 3.0], [6.0, 9.0], [12.0]]),
    }
    pads = [[1.0, 0.0], [2.0, 2.0]] if n == 2 else [[1.0]]  # y[:rank + 1] padded to the longest
    for value, pad in zip(values, pads):
        assert value == dict(expected, pad=pad)


def test_clip_grad_norm_on_micro_steps_returns_the_accumulated_norm(report):
    for value in report.assert_passed("check_clip_grad_norm_on_micro_steps_returns_the_norm"):
        for precision, rows in value.items():
            micro = [row for row in rows if not row[0]]
            sync = [row for row in rows if row[0]]
            assert len(micro) == len(sync) > 0, precision
            for _, norm, expected, unchanged in micro:  # the norm so far, unscaled; nothing clipped
                assert unchanged and norm == pytest.approx(expected, rel=1e-6), (precision, rows)
            for _, norm, expected, unchanged in sync:  # clipped (max_norm is tiny): returns the norm before
                assert not unchanged and norm == pytest.approx(expected, rel=1e-6), (precision, rows)


def test_break_keeps_the_position_and_a_new_for_starts_the_next_epoch(report):
    for value in report.assert_passed("check_break_keeps_the_position_and_a_new_for_starts_the_next_epoch"):
        reference = value["reference"]
        assert all(sorted(epoch) == list(range(20)) for epoch in reference) and reference[0] != reference[1]
        assert value["after_break"] == {"epoch": 0, "batches_yielded": 2}  # save_state resumes at the next batch
        assert value["after_exception"] == {"epoch": 1, "batches_yielded": 3}
        assert value["next_for"] == reference[2]  # like a plain DataLoader: a new for is a new epoch
        assert value["after_full_pass"] == {"epoch": 3, "batches_yielded": 0}
        assert value["break_at_last_batch"] == {"epoch": 4, "batches_yielded": 0}


def test_user_generator_drives_the_order(report):
    for value in report.assert_passed("check_user_generator_drives_the_order"):
        plain = value["plain"]
        assert plain[0] == plain[1] != plain[2]
        assert value["prepared"] == plain  # on 2 processes: gathered in the same global order
