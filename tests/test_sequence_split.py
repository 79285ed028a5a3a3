"""Sequences split over 2 real processes (checks in checks_sequence_split.py): context parallelism
(cp=2, torch's ring attention; on the CPU with the CPU kernel) and Ulysses sequence parallelism
(sp=2, all-to-all over heads under DDP and FSDP2) each equal one process on the same batch."""

import pytest

from distributed import run_checks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_sequence_split", world_size=2)


def _equal(values):
    for v in values:
        assert v["loss"] <= 1e-5 and v["grads"] <= 1e-5 and v["params"] <= 1e-5, v
    assert values[0]["losses"] == values[1]["losses"]  # the all-token mean, the same on both processes


def test_cp2_ring_attention_equals_one_process_loss_grads_and_params(two):
    values = two.assert_passed("check_cp2_equals_one_process")
    _equal(values)


def test_sp2_ulysses_under_ddp_equals_one_process(two):
    values = two.assert_passed("check_sp2_ddp_equals_one_process")
    _equal(values)
    assert values[0]["attn"] == "hasten_ulysses_sdpa" and values[0]["strategy"] == "DDPStrategy"
    assert [v["sp_rank"] for v in values] == [0, 1]


def test_sp2_ulysses_under_fsdp2_equals_one_process(two):
    values = two.assert_passed("check_sp2_fsdp2_equals_one_process")
    _equal(values)
    assert values[0]["strategy"] == "FSDP2Strategy"


def test_bad_sequence_layouts_are_refused_in_one_line(two):
    out = two.assert_passed("check_refusals")[0]
    assert "num_attention_heads=1, not a multiple of sp_size=2" in out["heads"]
    assert "outside accelerator.maybe_context_parallel" in out["outside"]
    assert "sequence length 15" in out["length"] and "sp_size=2" in out["length"]
    assert "padding" in out["mask"]
    assert "attention interface" in out["plain"] or "ALL_ATTENTION_FUNCTIONS" in out["plain"]
    assert "not a multiple of 4" in out["cp_length"]
    assert all("\n" not in text for text in out.values())
