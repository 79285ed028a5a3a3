"""Pipeline parallelism on 4 real gloo processes in the combinations test_pipeline_compose.py leaves out:
every other schedule, bf16 and checkpoints, each with FSDP2 (pp_size=2 x dp_shard_size=2) and with tensor
parallelism (pp_size=2 x tp_size=2). The checks of checks_pipeline_matrix.py run in one launch; the
one-process ends of the checkpoint conversions run here."""

import os

import pytest
import torch

from distributed import reset_state, run_checks

pytest.importorskip("transformers")

SCHEDULES = ("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _one_process():
    """The checkpoint tests' llama on one process (AdamW, StepLR, the same shuffled loader): ``acc, model, opt,
    loader, sched``."""
    import checks_pipeline_matrix as m

    from hasten import Accelerator

    reset_state()
    acc = Accelerator(gradient_accumulation_steps=2)
    model = m._llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(m._lm_full_data(64), batch_size=4, shuffle=True)
    return (acc, *acc.prepare(model, opt, loader, sched))


def _moments(model, opt) -> dict:
    """Every Adam moment, ``{name.key: tensor}``, on the host (the 4 processes' are gathered there)."""
    return {f"{n}.{k}": v.detach().cpu() for n, p in model.named_parameters() for k, v in opt.state[p].items()}


def _single_checkpoint(folder: str) -> None:
    """One process: 4 batches (2 optimizer steps), save_state to ``folder``; what was saved in ``folder.pt``."""
    import checks_pipeline_matrix as m

    acc, model, opt, loader, sched = _one_process()
    m._ckpt_run(acc, model, opt, sched, iter(loader), 4)
    acc.save_state(folder)
    torch.save({"params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
                "moments": _moments(model, opt), "lr": opt.param_groups[0]["lr"]}, folder + ".pt")
    reset_state()


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppmx"))
    _single_checkpoint(os.path.join(tmp, "single"))
    report = run_checks("checks_pipeline_matrix", world_size=4, timeout=400, env={"PPMX_TMP": tmp})
    report.tmp = tmp
    return report


def _close(result):
    assert all(result[k] < 1e-5 for k in ("loss", "norm", "grad", "param")), result


def _placed(ranks):
    """The stages each process ran (pp outermost: processes 0, 1 are the first pipeline rank's pair)."""
    firsts = {s: ranks[0][s]["stages"] for s in SCHEDULES}
    assert all(r[s]["stages"] == firsts[s] for r in ranks[:2] for s in SCHEDULES)
    assert firsts["GPipe"] == [0] and ranks[2]["GPipe"]["stages"] == [1]
    for looped in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"):  # pp_stages_per_rank=2
        assert firsts[looped] == [0, 2] and ranks[3][looped]["stages"] == [1, 3]
    for v_shaped in ("ZBVZeroBubble", "DualPipeV"):
        assert firsts[v_shaped] == [0, 3] and ranks[3][v_shaped]["stages"] == [1, 2]


# fsdp2: every parameter sharded over the stage's dp_shard pair; tp: split linears, replicated norms
KINDS = {"fsdp2": ["DTensor"], "tp": ["DTensor", "Parameter"]}


@pytest.mark.parametrize("with_", ["fsdp2", "tp"])
def test_each_schedule_equals_one_process(four, with_):
    ranks = four.assert_passed(f"check_each_schedule_with_{with_}_equals_one_process")
    _placed(ranks)
    for r in ranks:
        assert set(r) == set(SCHEDULES)
        for schedule in SCHEDULES:
            _close(r[schedule])
            assert r[schedule]["kinds"] == KINDS[with_]


def test_bf16_with_fsdp2_equals_one_process_bf16(four):
    """checks_pipeline's bf16 tolerances: the forward is one process's bf16 forward (1e-5 before the first
    update); gradients within bf16 rounding (2**-7 of each tensor's largest); after AdamW steps on them, 1e-2 / 5e-2."""
    for r in four.assert_passed("check_bf16_with_fsdp2_and_tp_equals_one_process_bf16"):
        r = r["fsdp2"]
        assert r["first_update_loss"] < 1e-5 and r["grad"] < 2 ** -7 and r["first_norm"] < 2 ** -7, r
        assert r["loss"] < 1e-2 and r["param"] < 5e-2 and r["kinds"] == ["DTensor"], r


def test_bf16_with_tp_equals_one_process_bf16_up_to_tp_rounding(four):
    """Tensor parallelism under bf16 adds roundings of its own: a row-wise linear's two partial products are
    rounded to bf16 before they are summed, so the forward is not one process's bf16 forward bit for bit. hasten's
    TensorParallelStrategy alone (tp_size=2, no pipeline) differs from one process bf16 by the same amounts on this
    model and batches (1.3e-4 on the first losses, 1.3e-2 of a gradient's largest element): the pipeline adds
    nothing. The bounds: 1e-3 and 2**-4 (5 to 8 times those), the first losses closer to one-process bf16 than
    bf16 is to fp32, and checks_pipeline's bounds after the AdamW steps."""
    for r in four.assert_passed("check_bf16_with_fsdp2_and_tp_equals_one_process_bf16"):
        r = r["tp"]
        assert r["first_update_loss"] < 1e-3 and r["first_update_loss"] < r["bf16_vs_fp32_loss"], r
        assert r["grad"] < 2 ** -4 and r["first_norm"] < 2 ** -7, r
        assert r["loss"] < 1e-2 and r["param"] < 5e-2 and r["kinds"] == ["DTensor", "Parameter"], r


def test_fsdp2_and_tp_checkpoints_resume_mid_epoch_exactly(four):
    for r in four.assert_passed("check_fsdp2_and_tp_checkpoints_resume_mid_epoch_exactly"):
        assert r["fsdp2"]["param"] < 1e-6 and r["tp"]["param"] < 1e-6, r
        assert r["fsdp2"]["layout"]["state_dict"] == "dcp" and r["fsdp2"]["layout"]["mesh"]["dp_shard"] == 2
        assert r["tp"]["layout"]["state_dict"] == "dcp" and r["tp"]["layout"]["mesh"]["tp"] == 2
        assert r["fsdp2"]["kinds"] == ["DTensor"] and "DTensor" in r["tp"]["kinds"]


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_pp_checkpoint_loads_into_one_process(four, kind, fresh_state):
    """A pp_size=2 x dp_shard_size=2 (or x tp_size=2) checkpoint read by the plain model on one process: every
    parameter and Adam moment equal to what the 4 processes held after loading it, and the learning rate."""
    four.assert_passed("check_fsdp2_and_tp_checkpoints_resume_mid_epoch_exactly")
    folder = os.path.join(four.tmp, kind)
    saved = torch.load(folder + ".pt", weights_only=True)
    acc, model, opt, loader, sched = _one_process()
    acc.load_state(folder, continue_dataloaders=True)
    params = {k: v.detach().cpu() for k, v in model.named_parameters()}
    assert set(params) == set(saved["params"]) and set(_moments(model, opt)) == set(saved["moments"])
    assert all(torch.equal(params[k], v) for k, v in saved["params"].items())
    assert all(torch.equal(_moments(model, opt)[k], v) for k, v in saved["moments"].items())
    assert opt.param_groups[0]["lr"] == saved["lr"]


def test_one_process_checkpoint_loads_under_fsdp2_and_tp(four):
    for r in four.assert_passed("check_one_process_checkpoint_loads_under_fsdp2_and_tp"):
        assert r["fsdp2"]["param"] == 0 and r["fsdp2"]["moment"] == 0 and r["fsdp2"]["lr"], r
        assert r["tp"]["param"] == 0 and r["tp"]["moment"] == 0 and r["tp"]["lr"], r
