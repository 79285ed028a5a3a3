"""Batches of any size and padded language-model batches under pipeline parallelism: the checks of
checks_pipeline_batches.py, on 2 real gloo processes (one launch) and on 4 (one launch); the rules
that need no process group, here."""

import pytest
import torch

from distributed import run_checks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_pipeline_batches", world_size=2, timeout=300)


@pytest.fixture(scope="module")
def four():
    return run_checks("checks_pipeline_batches", world_size=4, timeout=300, only=[
        "check_pp_times_dp_padded_last_batch_equals_one_process",
        "check_pp_times_fsdp2_stages_built_again_mid_accumulation_keep_gradients"])


def test_batches_of_any_size_equal_one_process_in_every_schedule(two):
    for r in two.assert_passed("check_sequential_batches_of_any_size_equal_one_process"):
        for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
            # 3 samples: microbatches of 1 row; 8: built again for 2; 7 and 2 run in that shape
            assert r[schedule]["builds"] == 2, r[schedule]


def test_padded_lm_loss_is_the_token_mean_of_the_whole_batch(two):
    for r in two.assert_passed("check_llama_padded_batches_equal_one_process"):
        for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
            assert r[schedule]["builds"] == 2, r[schedule]  # 1 row x 8 tokens, then 2 x 10
        # a mean of the microbatches' token means misses by far more than the 1e-5 the check allows
        assert r["mean_of_means_would_differ_by"] > 1e-3, r


def test_eval_of_uneven_batches_returns_their_own_rows(two):
    for r in two.assert_passed("check_eval_of_uneven_batches_gives_their_rows"):
        assert r["seq_8"]["shape"] == [8, 8] and r["seq_3"]["shape"] == [3, 8]
        assert r["lm_[6, 10]"]["shape"] == [6, 10, 64] and r["lm_[3, 5]"]["shape"] == [3, 5, 64]


def test_left_padding_and_labels_scored_from_padding_are_refused(two):
    for r in two.assert_passed("check_left_padding_and_scored_padding_are_refused"):
        assert "right" in r["left"] and "padding_side" in r["left"], r["left"]
        assert "-100" in r["scored"] and "padding" in r["scored"], r["scored"]
        assert r["after"] < 1e-5


def test_pp_times_dp_with_even_batches_padding_equals_one_process(four):
    for r in four.assert_passed("check_pp_times_dp_padded_last_batch_equals_one_process"):
        assert r["sizes"] == [12, 12] and r["repeated"] == 2, r


def test_pp_times_fsdp2_keeps_gradients_when_stages_are_built_again(four):
    for r in four.assert_passed("check_pp_times_fsdp2_stages_built_again_mid_accumulation_keep_gradients"):
        assert r["builds"] == 2, r


# -- the rules, in this process -----------------------------------------------------------------
def test_right_padding_is_accepted_and_what_needs_the_mask_is_named():
    from hasten.pipeline.batches import refused_padding

    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    labels = torch.tensor([[5, 6, 7, -100], [1, 2, 3, 4]])  # 7 is predicted from token 6; -100 from padding
    assert refused_padding(mask, labels, decoder=True) is None
    assert "padding_side" in refused_padding(mask.flip(1), labels.flip(1), decoder=True)
    assert "-100" in refused_padding(mask, torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), decoder=True)
    assert "decoder LM" in refused_padding(mask, labels, decoder=False)
    assert refused_padding(torch.ones(2, 4), labels, decoder=False) is None


def test_a_batch_is_completed_with_copies_of_its_rows_and_padding_tokens():
    from hasten.pipeline.batches import completed, padded_labels

    ids = torch.tensor([[3, 4], [5, 6], [7, 8]])
    assert completed(ids, 4, 3).tolist() == [[3, 4, 0], [5, 6, 0], [7, 8, 0], [3, 4, 0]]
    assert padded_labels(ids, 4, 3).tolist() == [[3, 4, -100], [5, 6, -100], [7, 8, -100], [-100] * 3]
    x = torch.randn(2, 5)
    assert torch.equal(completed(x, 4, 0), torch.cat([x, x]))
