"""Issue 24 item 3: a compiled prepared model (``dynamo_backend``) keeps ``accumulate``/``no_sync``:
DDP all-reduces once per accumulation window, FSDP2 reduces only on the window's last micro-step.
2 real gloo processes with the ``eager`` dynamo backend (fast on CPU)."""

import pytest

from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_nosync_compile", world_size=2)


def test_ddp_without_compile_all_reduces_once_per_window(two):
    seen = two.assert_passed("check_ddp_eager_counts_one_allreduce_per_window")
    assert [s["per_window"] for s in seen] == [[1, 1], [1, 1]]


def test_ddp_compiled_all_reduces_once_per_window_and_trains_as_eager(two):
    seen = two.assert_passed("check_ddp_compiled_counts_one_allreduce_per_window")
    assert [s["per_window"] for s in seen] == [[1, 1], [1, 1]]
    eager = two.assert_passed("check_ddp_eager_counts_one_allreduce_per_window")
    for compiled_rank, eager_rank in zip(seen, eager):  # same updates: the window's mean gradient
        assert compiled_rank["weights"] == pytest.approx(eager_rank["weights"], abs=1e-6)


def test_ddp_compiled_no_sync_skips_and_trigger_sync_forces(two):
    assert two.assert_passed("check_ddp_compiled_no_sync_and_trigger_sync") == [[0, 1], [0, 1]]


def test_fsdp2_compiled_reduces_only_on_the_last_micro_step(two):
    expected = [False, False, False, True]
    assert two.assert_passed("check_fsdp2_eager_micro_steps_keep_grads_unreduced") == [expected, expected]
    assert two.assert_passed("check_fsdp2_compiled_micro_steps_keep_grads_unreduced") == [expected, expected]


def test_deepspeed_clip_grad_norm_works_with_and_without_gradient_clipping(two):
    """The loop the user wrote runs under ZeRO-2 whether or not ``--gradient_clipping`` was given
    (clip_grad_norm_ sets the engine's clipping; tests/test_issue24_rest.py checks the numbers)."""
    pytest.importorskip("deepspeed")
    seen = two.assert_passed("check_deepspeed_clip_without_gradient_clipping_names_the_flag")
    assert seen[0] == seen[1], seen  # every rank, the same
    assert seen[0] == {"None": True, "1.0": True}, seen


def test_unwrap_compiled_is_the_one_way_to_strip_torch_compile():
    import torch
    from torch import nn

    from hasten.utils.other import extract_model_from_parallel, unwrap_compiled

    inner = nn.Linear(2, 2)
    compiled = torch.compile(inner, backend="eager")
    assert unwrap_compiled(compiled) is inner
    assert unwrap_compiled(inner) is inner and unwrap_compiled("x") == "x"
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is inner
