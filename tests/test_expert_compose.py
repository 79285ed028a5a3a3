"""Expert parallelism composed with pipeline stages (checks in checks_expert_compose.py): one launch of
4 gloo processes, pp_size=2 x dp_shard_size=2 and pp_size=2 x tp_size=2, each with ep_size=2; the tests
judge what the ranks reported."""

import pytest

from distributed import run_checks

pytest.importorskip("transformers")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def four():
    return run_checks("checks_expert_compose", world_size=4)


def test_pp2_with_ep2_equals_one_process(four):
    """Losses, first gradients, clipped norms and weights after 3 AdamW steps (accumulation 2, 1F1B with
    2 microbatches) within 1e-5 of one process; each stage's experts split over its own dp_shard pair."""
    results = four.assert_passed("check_pp2_with_ep2_equals_one_process")
    for rank, r in enumerate(results):
        print("pp2 x ep2, largest differences from one process:", {k: r[k] for k in ("loss", "norm", "grad", "param")})
        assert all(r[k] < TOLERANCE for k in ("loss", "norm", "grad", "param")), r
        assert r["mesh"] == "ParallelMesh(pp=2, dp_replicate=1, dp_shard=2, cp=1, sp=1, tp=1, ep=2)"
        assert r["stages"] == [rank // 2] and r["experts"] == 2  # 2 decoder layers per stage
        assert r["local_shape"] == [2, 32, 32]  # 2 of the 4 experts of each layer
        assert r["ep_ranks"] == ([0, 1] if rank < 2 else [2, 3])  # tokens travel within the stage only
        assert r["classes"] == ["FSDPExpertParallelQwen3MoeExperts"]


def test_pp2_with_tp2_and_ep2_equals_one_process(four):
    """Each stage's tp pair splits its attention by Mixtral's tp plan and its experts whole over ep (borrowing
    the tp pair): losses, first gradients, norms and weights after 3 AdamW steps within 1e-5 of one process."""
    for rank, r in enumerate(four.assert_passed("check_pp2_with_tp2_and_ep2_equals_one_process")):
        print("pp2 x tp2 x ep2, largest differences from one process:", {k: r[k] for k in ("loss", "norm", "grad", "param")})
        assert all(r[k] < TOLERANCE for k in ("loss", "norm", "grad", "param")), r
        assert r["mesh"] == "ParallelMesh(pp=2, dp_replicate=1, dp_shard=1, cp=1, sp=1, tp=2, ep=2)"
        assert r["experts"] == 2 and r["local_shape"] == [2, 32, 32]
        assert r["ep_ranks"] == ([0, 1] if rank < 2 else [2, 3])  # the stage's tp pair


def test_router_aux_loss_under_pipeline_is_refused_in_one_line(four):
    """hasten's pipeline computes the last stage's loss only: a model adding the router's load-balancing loss
    (output_router_logits) is refused, with the way out."""
    for message in four.assert_passed("check_router_aux_loss_under_pp_is_refused_in_one_line"):
        assert "router_aux_loss_coef=0.1" in message and "output_router_logits = False" in message
        assert "pp_size=1" in message and "\n" not in message


def test_layout_rule_lets_ep_borrow_each_stages_dp_shard_processes():
    from hasten.layout import Layout

    Layout.from_sizes({"pp": 2, "dp_shard": 2, "ep": 2}, 4).check()
    with pytest.raises(ValueError, match=r"ep_size=2 does not divide dp_shard_size=3"):
        Layout.from_sizes({"pp": 2, "dp_shard": 3, "ep": 2}, 6).check()
