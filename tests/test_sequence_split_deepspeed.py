"""Ulysses sequence parallelism under DeepSpeed ZeRO on 2 real processes (checks in
checks_sequence_split_deepspeed.py): ParallelismConfig(sp_size=2) with a deepspeed_plugin runs DeepSpeed's
UlyssesSPAttentionHF (its sp groups handed to the engine as mpu) and equals one process on the same batches;
on 4 processes (dp_replicate=2 x sp=2) too."""

import pytest

from distributed import run_checks

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
pytest.importorskip("einops")  # DeepSpeed's Ulysses module imports it


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_sequence_split_deepspeed", world_size=2,
                      only=["check_sp2_zero2_equals_one_process", "check_sp2_zero3_equals_one_process",
                            "check_sp2_zero3_without_reduce_scatter_equals_one_process", "check_sp_deepspeed_refusals",
                            "check_plain_deepspeed_after_sp"])


def _equal(values, sums):
    for v in values:
        assert v["loss"] <= 1e-5 and v["params"] <= 1e-5, v  # SGD: a gradient off by sp_size would show
        assert v["same_batches"] == [True] * 3 and v["steps"] == 3, v  # sp is no data axis: one batch for both
        assert v["attn"] == "hasten_ds_ulysses_sdpa" and v["engine"] == "DeepSpeedEngine", v
        assert v["train_batch_size"] == 2, v  # micro-batch 2 x 1 data-parallel process (not x 2 processes)
        assert v["sums_over_sp"] is sums, v
    assert values[0]["losses"] == values[1]["losses"]  # the all-token mean, the same on both processes


def test_sp2_under_zero2_equals_one_process(two):
    _equal(two.assert_passed("check_sp2_zero2_equals_one_process"), sums=True)


def test_sp2_under_zero3_equals_one_process(two):
    _equal(two.assert_passed("check_sp2_zero3_equals_one_process"), sums=False)  # reduce-scatter averages


def test_sp2_under_zero3_without_reduce_scatter_equals_one_process(two):
    _equal(two.assert_passed("check_sp2_zero3_without_reduce_scatter_equals_one_process"), sums=True)


def test_refusals_name_the_fix(two):
    out = two.assert_passed("check_sp_deepspeed_refusals")[0]
    assert "needs DeepSpeed's engine: pass a deepspeed_plugin" in out["no_deepspeed"], out
    assert "num_key_value_heads=1, not a multiple of sp_size=2" in out["kv_heads"], out
    assert all("\n" not in text for text in out.values())


def test_engine_without_sp_after_an_sp_engine(two):
    out = two.assert_passed("check_plain_deepspeed_after_sp")[0]
    assert out["sequence_parallel_size"] == 1 and out["mpu"] == "None", out
    assert out["train_batch_size"] == 4, out


@pytest.fixture(scope="module")
def four():
    return run_checks("checks_sequence_split_deepspeed", world_size=4,
                      only=["check_dp2_sp2_zero2_equals_one_process", "check_dp2_sp2_zero3_equals_one_process"])


@pytest.mark.parametrize("stage", [2, 3])
def test_dp2_sp2_on_four_processes_equals_one_process(four, stage):
    for v in four.assert_passed(f"check_dp2_sp2_zero{stage}_equals_one_process"):
        assert v["loss"] <= 1e-5 and v["params"] <= 1e-5, v
        assert v["same_batches"] == [True] * 3 and v["train_batch_size"] == 2, v  # 1 row x 2 data-parallel
