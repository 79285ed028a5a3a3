"""Pipeline parallelism composed with FSDP2, tensor parallelism and replicas: the checks of
checks_pipeline_compose.py run on 4 real gloo processes, in one launch."""

import pytest

from distributed import run_checks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def four():
    return run_checks("checks_pipeline_compose", world_size=4, timeout=300)


def _close(result):
    assert all(result[k] < 1e-5 for k in ("loss", "norm", "grad", "param")), result


def test_pp_times_fsdp2_equals_one_process(four):
    for r in four.assert_passed("check_pp_fsdp2_equals_one_process"):
        _close(r["sequential"])
        _close(r["llama"])
        assert r["llama"]["kinds"] == ["DTensor"]  # every parameter sharded over the stage's dp_shard pair
        # accumulation micro-steps: FSDP2's gradient sync is off (no reduce-scatter until the sync step)


def test_pp_times_tp_equals_one_process(four):
    for r in four.assert_passed("check_pp_tp_equals_one_process"):
        _close(r)
        assert "DTensor" in r["kinds"] and "Parameter" in r["kinds"]  # split linears, replicated norms


def test_eval_predictions_gathered_and_no_sync(four):
    for r in four.assert_passed("check_eval_gather_for_metrics_and_no_sync"):
        assert r["preds"] < 1e-5 and r["grad"] < 1e-5 and r["replicas_differ_inside"]
