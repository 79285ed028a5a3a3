"""Pipeline parallelism (torch.distributed.pipelining) behind the four-line loop: checks in checks_pipeline.py
run on 2 real gloo processes; the split rule and its errors are checked here, in one process."""

import pytest
import torch
from torch import nn

from distributed import run_checks

pytest.importorskip("transformers")

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_pipeline", world_size=2, timeout=300)


def _close(result):
    assert result["loss"] < 1e-5 and result["norm"] < 1e-5 and result["grad"] < 1e-5 and result["param"] < 1e-5


def test_sequential_each_schedule_equals_one_process(two):
    ranks = two.assert_passed("check_sequential_each_schedule_equals_one_process")
    for schedule in SCHEDULES + ("LoopedBFS", "DualPipeV"):
        for r in ranks:
            _close(r[schedule])
    assert ranks[0]["GPipe"]["stages"] == [0] and ranks[1]["GPipe"]["stages"] == [1]
    assert ranks[0]["Interleaved1F1B"]["stages"] == [0, 2] and ranks[1]["Interleaved1F1B"]["stages"] == [1, 3]
    assert ranks[0]["ZBVZeroBubble"]["stages"] == [0, 3] and ranks[1]["ZBVZeroBubble"]["stages"] == [1, 2]
    # the original names: 4 blocks, 2 on each process (one stage of 2 blocks, or 2 stages of 1)
    assert ranks[0]["GPipe"]["names"] == ["0.0.bias", "0.0.weight", "1.0.bias", "1.0.weight"]
    assert ranks[1]["Interleaved1F1B"]["names"] == ["1.0.bias", "1.0.weight", "3.0.bias", "3.0.weight"]


def test_llama_each_schedule_equals_one_process(two):
    ranks = two.assert_passed("check_llama_each_schedule_equals_one_process")
    for schedule in SCHEDULES:
        for r in ranks:
            _close(r[schedule])
    first, last = ranks[0]["1F1B"]["names"], ranks[1]["1F1B"]["names"]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last and "model.norm.weight" in last
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"2", "3"}


def test_split_points_and_logits_on_the_last_stage(two):
    first, last = two.assert_passed("check_llama_split_points_and_logits")
    assert {n.split(".")[2] for n in first["names"] if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in last["names"] if n.startswith("model.layers.")} == {"1", "2", "3"}
    assert first["logits"] is None and last["logits"] < 1e-5
    assert first["restored"] and last["restored"]  # save_state/load_state of a llama at pp_size=2


def test_a_changed_loss_is_refused_by_backward(two):
    for message in two.assert_passed("check_changed_loss_is_refused"):
        assert "outputs.loss" in message and "pipeline" in message


def test_too_few_layers_is_refused(two):
    for message in two.assert_passed("check_too_few_layers_is_refused"):
        assert "3" in message and "4 stages" in message and "pp_split_points" in message


def test_a_sequential_without_its_loss_is_refused(two):
    for message in two.assert_passed("check_sequential_without_a_loss_is_refused"):
        assert "hasten.pipeline.pipeline_loss(model, loss_fn)" in message


def test_eval_under_no_grad_gives_the_loss_and_no_gradient(two):
    assert all(diff < 1e-5 for diff in two.assert_passed("check_eval_under_no_grad_changes_no_gradient"))


def test_bf16_equals_one_process_bf16(two):
    for r in two.assert_passed("check_bf16_equals_one_process_bf16"):
        assert r["first_update_loss"] < 1e-5 and r["grad"] < 2 ** -7 and r["first_norm"] < 2 ** -7, r
        assert r["loss"] < 1e-2 and r["param"] < 5e-2, r


def test_activation_checkpointing_per_stage_equals_one_process(two):
    for r in two.assert_passed("check_activation_checkpointing_equals_one_process"):
        for case, got in r.items():
            assert all(got[k] < 1e-5 for k in ("loss", "norm", "grad", "param")), (case, got)
            assert not any("_checkpoint_wrapped_module" in n for n in got["names"]), got["names"]
        assert r["llama 1F1B"]["wrapped"] == 2  # this process's 2 of the 4 decoder layers
        assert r["llama Interleaved1F1B"]["wrapped"] == 2  # two stages of one layer each
        assert r["sequential every_k"]["wrapped"] == 1  # blocks 0 and 2 of 4: one on each stage


def test_fp16_is_refused_naming_bf16(two):
    for message in two.assert_passed("check_fp16_is_refused"):
        assert "mixed_precision='fp16' is not supported" in message and "'bf16'" in message


def test_pp_times_dp_on_four_processes_equals_one_process():
    four = run_checks("checks_pipeline", world_size=4, timeout=300, only=["check_pp_times_dp_equals_one_process"])
    ranks = four.assert_passed("check_pp_times_dp_equals_one_process")
    for r in ranks:
        assert all(v["norm"] < 1e-5 and v["param"] < 1e-5 for v in r.values())
    assert [r["1F1B"]["replica"] for r in ranks] == [0, 1, 0, 1]  # pp outermost: ranks 0, 1 are stage 0


# -- the split rule, in this process ------------------------------------------------------------
def test_even_split_gives_earlier_stages_the_extra_layer():
    from hasten.pipeline.split import plan_stages

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    assert plan_stages(model, 2) == [["0", "1", "2"], ["3", "4"]]
    assert plan_stages(model, 3) == [["0", "1"], ["2", "3"], ["4"]]
    assert plan_stages(model, 2, ["1"]) == [["0"], ["1", "2", "3", "4"]]


def test_llama_split_by_its_pp_plan():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hasten.pipeline.split import plan_stages

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2)
    stages = plan_stages(LlamaForCausalLM(cfg), 2)
    assert stages == [["model.embed_tokens", "model.layers.0", "model.layers.1"],
                      ["model.layers.2", "model.norm", "lm_head"]]


@pytest.mark.parametrize("points, words", [
    (["2"], ["pp_split_points", "'2'", "names of"]),  # not a layer name
    (["1", "1"], ["pp_split_points", "increasing"]),  # needs 1 point for 2 stages, and in order
    (["0"], ["pp_split_points", "'0'", "first"]),  # an empty first stage
])
def test_bad_split_points_are_named(points, words):
    from hasten.pipeline.split import plan_stages

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError) as info:
        plan_stages(model, 2 if len(points) == 1 else 3, points)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_a_model_without_layers_is_refused():
    from hasten.pipeline.split import plan_stages

    with pytest.raises(ValueError, match="pp_split_points"):
        plan_stages(nn.Linear(2, 2), 2)


def test_weights_tied_across_stages_are_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hasten.pipeline.split import plan_stages
    from hasten.strategies.pipeline import _refuse_shared_across_stages

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        _refuse_shared_across_stages(model, plan_stages(model, 2))
