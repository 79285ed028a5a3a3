"""Bitwise exact resume in new processes: 1 and 2 processes, mid-epoch, mid-accumulation, workers,
end of epoch, iterable datasets resumed through their own state_dict (dispatched or sharded);
and resuming on another number of processes (2 -> 1, 1 -> 2)."""

import pytest
from checks_checkpoint_resume import BATCH, N, N_STREAM, SCENARIOS
from distributed import run_checks

NAMES = sorted(SCENARIOS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt-resume"))
    out = {}
    for phase in ("save", "resume"):
        for ws in (1, 2):
            env = {"CKPT_ROOT": root, "CKPT_PHASE": phase}
            out[phase, ws] = run_checks("checks_checkpoint_resume", world_size=ws, env=env)
    return out


def _keyed(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_resume_is_bitwise_identical(runs, name, ws):
    saved = runs["save", ws].assert_passed(f"check_{name}")
    resumed = runs["resume", ws].assert_passed(f"check_{name}")
    at = SCENARIOS[name]["save_at"][ws]
    if "mirrors" in SCENARIOS[name]:  # the run that saved stopped there: compare with the one it mirrors
        assert [max(_keyed(s["losses"])) for s in saved] == [at] * ws
        assert all(s["checkpoints"] == ["checkpoint_0"] for s in saved)
        saved = runs["save", ws].assert_passed(f"check_{SCENARIOS[name]['mirrors']}")
    for rank in range(ws):
        ref, res = saved[rank], resumed[rank]
        assert ref["checkpoints"] == ["checkpoint_0"]
        assert res["loaded"] == "checkpoint_0" and res["iteration"] == 1  # the next save is checkpoint_1
        ref_losses, res_losses = _keyed(ref["losses"]), _keyed(res["losses"])
        assert sorted(res_losses) == [s for s in sorted(ref_losses) if s > at]  # the very next batch, no replay
        assert res_losses == {s: v for s, v in ref_losses.items() if s > at}  # bitwise (floats compared exactly)
        assert _keyed(res["seen"]) == {s: v for s, v in _keyed(ref["seen"]).items() if s > at}
        assert res["weights"] == ref["weights"]
    if ws == 2:  # the ranks really trained together
        assert saved[0]["weights"] == saved[1]["weights"]


def _in_order(ranks: list, epoch: int, keep) -> list:
    """The samples of ``epoch`` in the order of the global batch sequence (steps, then ranks)."""
    steps = sorted({s for rank in ranks for s in _keyed(rank["seen"])})
    return [i for s in steps if keep(s) for rank in ranks for e, idx in [_keyed(rank["seen"]).get(s, (None, []))]
            if e == epoch for i in idx]


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("name", ["mid_epoch", "other_seed", "user_generator"])
def test_resume_on_another_number_of_processes(runs, ws, name):
    other = 2 if ws == 1 else 1
    check = "check_cross_world_size" + ("" if name == "mid_epoch" else f"_{name}")
    cross = runs["resume", ws].assert_passed(check)
    before = runs["save", other].assert_passed(f"check_{name}")
    at = SCENARIOS[name]["save_at"][other]
    epoch = cross[0]["epoch"]
    consumed = _in_order(before, epoch, lambda s: s <= at)
    after = _in_order(cross, epoch, lambda s: True)
    assert sorted(consumed + after) == list(range(N))  # every sample of the epoch once: no skip, no replay
    assert after == _in_order(before, epoch, lambda s: s > at)  # in the uninterrupted run's order
    for rank in cross:
        assert "gradient-accumulation window" in rank["refused"] and rank["untouched"]
        assert any("saved by" in w and "processes" in w for w in rank["warnings"])


@pytest.mark.parametrize("ws", [1, 2])
def test_saving_does_not_change_the_run(runs, ws):
    never_saved = runs["save", ws].assert_passed("check_saving_does_not_change_training")
    saved = runs["save", ws].assert_passed("check_mid_accum")
    assert [v for v in never_saved] == [s["weights"] for s in saved]


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("name", ["stream_dispatch", "stream_shards"])
def test_iterable_dataset_resumes_through_its_state_without_rereading(runs, name, ws):
    resumed = runs["resume", ws].assert_passed(f"check_{name}")
    consumed = SCENARIOS[name]["save_at"][ws] * BATCH * ws  # samples handed out before the save
    dispatch = SCENARIOS[name]["dispatch"]
    for rank in range(ws):
        reads = {int(k): v for k, v in resumed[rank]["reads"].items()}
        if dispatch and rank > 0:
            assert reads == {}  # only process 0 reads
            continue
        # Epoch 0 continues after the consumed samples: none of them is read again; the batches the
        # loader had read ahead come from the checkpoint (at most a step and a batch). Epoch 1 reads all.
        assert N_STREAM - consumed - 3 * BATCH * ws <= reads[0] <= N_STREAM - consumed - BATCH
        assert reads[1] == N_STREAM
