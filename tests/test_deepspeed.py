"""DeepSpeed ZeRO on 2 real processes over gloo (checks in checks_deepspeed.py), plus single-process pieces."""

import pytest

from distributed import run_checks

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_deepspeed", world_size=2)


@pytest.mark.parametrize("name", ["check_zero1_equals_ddp", "check_zero2_equals_ddp_accumulation",
                                  "check_zero3_equals_ddp_accumulation", "check_zero3_equals_ddp"])
def test_zero_stage_equals_ddp_on_two_processes(two, name):
    values = two.assert_passed(name)
    assert values[0]["norms"] == values[1]["norms"]
    assert all(v["worst"] < 1e-5 for v in values)


def test_bf16_trains(two):
    two.assert_passed("check_bf16_trains")


def test_json_with_auto_values_dummy_optimizer_and_scheduler(two):
    two.assert_passed("check_json_auto_values_and_dummies")


def test_exact_resume_zero3(two):
    two.assert_passed("check_exact_resume_zero3")


def test_exact_resume_zero2_with_accumulation(two):
    two.assert_passed("check_exact_resume_zero2_accumulation")


def test_save_model_on_every_rank_zero3(two):
    two.assert_passed("check_save_model_every_rank")


def test_transformers_zero3_save_model_reloads_with_from_pretrained(two):
    two.assert_passed("check_transformers_zero3_save_model_reloads")


def test_zero3_init_flag_builds_transformers_models_partitioned(two):
    two.assert_passed("check_zero3_init_flag_builds_partitioned_models")


def test_bad_inputs_name_the_value_and_the_fix(two):
    two.assert_passed("check_bad_inputs")


def test_other_process_count_is_refused_before_anything_changes(two):
    folder = two.assert_passed("check_resume_on_other_world_size_refused")[0]
    one = run_checks("checks_deepspeed", world_size=1, env={"DS_FOLDER": folder}, only=["check_load_on_one_process"])
    message = one.assert_passed("check_load_on_one_process")[0]
    assert "2 processes" in message and "this run has 1" in message, message


def test_zero3_fp32_holds_each_partition_once(two):
    two.assert_passed("check_zero3_fp32_keeps_one_copy_of_partitions")


def test_fp16_on_a_cpu_without_fp16_is_one_clear_error(two):
    message = two.assert_passed("check_fp16_on_cpu_without_support_is_one_clear_error")[0]
    if message == "supported":
        pytest.skip("this CPU runs DeepSpeed fp16")


def test_fp16_overflow_skips_the_step_and_the_scheduler(two):
    two.assert_passed("check_fp16_overflow_skips_step_and_scheduler")
