"""DeepSpeed ZeRO on 2 real processes over gloo (checks in checks_deepspeed.py), plus single-process pieces."""

import os
import shutil

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


def test_checkpoint_loads_on_another_process_count_and_back(two):
    """2 processes (ZeRO-2) -> 1 process (ZeRO-2, ZeRO-3, plain) -> 2 processes (ZeRO-2): consolidated weights."""
    folder = two.assert_passed("check_resume_on_other_world_size")[0]
    one = run_checks("checks_deepspeed", world_size=1, env={"DS_FOLDER": folder}, only=["check_load_on_one_process"])
    result = one.assert_passed("check_load_on_one_process")[0]
    assert all(v < 1e-6 for v in result["worst"].values()), result
    assert "moments, step counts" in result["warning"], result
    assert "saved by ZeRO stage 2 on 2 processes, this run ZeRO stage 2 on 1 process(es)" in result["refused"]
    assert "nothing was changed" in result["refused"], result
    saved_by_one = os.path.join(os.path.dirname(folder), "from_one")
    back = run_checks("checks_deepspeed", world_size=2, env={"DS_FOLDER": saved_by_one},
                      only=["check_load_back_on_two_processes"])
    back.assert_passed("check_load_back_on_two_processes")


def test_checkpoint_of_another_stage_loads_as_weights(two):
    two.assert_passed("check_zero_checkpoints_for_merge_weights")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_merge_weights_consolidates_zero_checkpoints(two, tmp_path, stage):
    """A hasten checkpoint in a fresh process (no process group can exist); its DeepSpeed folder and tag in this one."""
    from safetensors.torch import load_file

    from hasten.commands.cli import main
    from test_merge_weights import assert_same, fresh_process_merge

    root = two.assert_passed("check_zero_checkpoints_for_merge_weights")[0]
    source = os.path.join(root, f"zero{stage}")
    expected = load_file(os.path.join(root, f"zero{stage}.safetensors"))
    result = fresh_process_merge(source, str(tmp_path / "hasten"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hasten merge-weights: wrote 6 tensors"), result.stdout
    for what, folder in (("hasten", source), ("raw", os.path.join(source, "deepspeed")),
                         ("tag", os.path.join(source, "deepspeed", "model_0"))):
        if what != "hasten":
            assert main(["merge-weights", folder, str(tmp_path / what)]) == 0
        assert os.listdir(tmp_path / what) == ["model.safetensors"], what
        assert_same(load_file(tmp_path / what / "model.safetensors"), expected)


def test_merge_weights_zero_sharded_output(two, tmp_path):
    from safetensors.torch import load_file

    from hasten.commands.cli import main
    from test_merge_weights import assert_same

    root = two.assert_passed("check_zero_checkpoints_for_merge_weights")[0]
    assert main(["merge-weights", os.path.join(root, "zero3"), str(tmp_path / "out"), "--max_shard_size", "600B"]) == 0
    files = sorted(os.listdir(tmp_path / "out"))
    assert "model.safetensors.index.json" in files and len(files) > 2, files
    merged = {}
    for name in files:
        if name.endswith(".safetensors"):
            merged.update(load_file(tmp_path / "out" / name))
    assert_same(merged, load_file(os.path.join(root, "zero3.safetensors")))


def test_merge_weights_zero_bad_inputs(two, tmp_path, capsys):
    from test_cli import one_line_error

    from hasten.commands.cli import main

    root = two.assert_passed("check_zero_checkpoints_for_merge_weights")[0]
    half = tmp_path / "half"
    shutil.copytree(os.path.join(root, "zero2", "deepspeed"), half)
    os.remove(half / "model_0" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    err = one_line_error(capsys, ["merge-weights", str(half), str(tmp_path / "o")])
    assert "cannot rebuild the weights of the DeepSpeed checkpoint" in err and "incomplete or damaged" in err, err
    (half / "model_0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a pickle")
    err = one_line_error(capsys, ["merge-weights", str(half / "model_0"), str(tmp_path / "o")])
    assert "incomplete or damaged" in err, err
    ck = tmp_path / "ck"
    shutil.copytree(os.path.join(root, "zero3"), ck)
    os.remove(ck / "deepspeed" / "model_0" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    err = one_line_error(capsys, ["merge-weights", str(ck), str(tmp_path / "o")])
    assert "is incomplete: missing files: deepspeed/model_0/zero_pp_rank_1_mp_rank_00_model_states.pt" in err, err
    two_tags = tmp_path / "two_tags"
    shutil.copytree(os.path.join(root, "zero1", "deepspeed", "model_0"), two_tags / "step1")
    shutil.copytree(os.path.join(root, "zero1", "deepspeed", "model_0"), two_tags / "step2")
    err = one_line_error(capsys, ["merge-weights", str(two_tags), str(tmp_path / "o")])
    assert "several DeepSpeed checkpoints (step1, step2)" in err, err
    assert not (tmp_path / "o").exists()
    (two_tags / "latest").write_text("step3")
    assert "names the DeepSpeed checkpoint 'step3'" in one_line_error(capsys, ["merge-weights", str(two_tags), "o"])
    (two_tags / "latest").write_text("step2\n")
    assert main(["merge-weights", str(two_tags), str(tmp_path / "o")]) == 0
    assert os.listdir(tmp_path / "o") == ["model.safetensors"]


def test_tampered_engine_checkpoint_runs_nothing(two):
    """Issue #18 item 9: DeepSpeed's own resume reads no pickle that hasten's allow-list refuses."""
    values = two.assert_passed("check_tampered_engine_checkpoint_runs_nothing")
    assert values[0] == values[1]


def test_merge_weights_refuses_a_tampered_partition(two, tmp_path, capsys):
    from distributed import evil_pickle
    from test_cli import one_line_error

    root = two.assert_passed("check_zero_checkpoints_for_merge_weights")[0]
    evil, marker = tmp_path / "evil", tmp_path / "created_by_a_pickle"
    shutil.copytree(os.path.join(root, "zero2", "deepspeed", "model_0"), evil)
    (evil / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(evil_pickle(str(marker)))
    err = one_line_error(capsys, ["merge-weights", str(evil), str(tmp_path / "o")])
    assert not marker.exists(), err
    assert str(evil / "zero_pp_rank_1_mp_rank_00_optim_states.pt") in err and "io.open" in err, err
    assert "tampered" in err and not (tmp_path / "o").exists(), err


def test_consolidating_flips_no_process_wide_setting(two):
    """Issue #18 item 11: while weights are consolidated, another thread's torch.load(weights_only=False)
    of a pickle that holds more than tensors works (no process-wide weights-only switch, no allow-list
    change)."""
    import fractions
    import io
    import threading

    import torch

    from hasten.checkpointing.deepspeed_state import consolidated_weights

    root = two.assert_passed("check_zero_checkpoints_for_merge_weights")[0]
    buffer = io.BytesIO()
    torch.save({"ratio": fractions.Fraction(1, 3)}, buffer)
    allowed_before = list(torch.serialization.get_safe_globals())
    stop, loads, failures = threading.Event(), [0], []

    def other_thread():
        while not stop.is_set():
            try:
                assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)["ratio"] == fractions.Fraction(1, 3)
                loads[0] += 1
            except Exception as e:  # noqa: BLE001
                failures.append(f"{type(e).__name__}: {str(e)[:200]}")

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        for stage in (1, 2, 3, 0):
            for _ in range(3):
                consolidated_weights(os.path.join(root, f"zero{stage}", "deepspeed", "model_0"))
    finally:
        stop.set()
        thread.join()
    assert not failures, failures[:3]
    assert loads[0] > 0 and torch.serialization.get_safe_globals() == allowed_before
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_zero3_fp32_holds_each_partition_once(two):
    two.assert_passed("check_zero3_fp32_keeps_one_copy_of_partitions")


def test_fp16_on_a_cpu_without_fp16_is_one_clear_error(two):
    message = two.assert_passed("check_fp16_on_cpu_without_support_is_one_clear_error")[0]
    if message == "supported":
        pytest.skip("this CPU runs DeepSpeed fp16")


def test_fp16_overflow_skips_the_step_and_the_scheduler(two):
    two.assert_passed("check_fp16_overflow_skips_step_and_scheduler")
