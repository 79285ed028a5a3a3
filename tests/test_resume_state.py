"""Optimizer hyperparameters survive every layout's resume, micro-step gradient norms agree across
layouts, and load_state loads what the run has (checks on 2 processes in checks_resume_state.py;
the one-process loads run here)."""

import os
import warnings

import pytest
import torch

from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_resume_state", world_size=2)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "tp"])
def test_stateless_sgd_resumes_with_the_schedulers_lr(two, kind):
    values = two.assert_passed(f"check_sgd_lr_resumes_{kind}")
    assert values[0]["lr"] == values[1]["lr"] < 0.1


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "tp"])
def test_adam_saved_before_its_first_step_resumes_exactly(two, kind):
    two.assert_passed(f"check_adam_before_first_step_{kind}")


def test_fsdp2_micro_step_norms_equal_ddp(two):
    values = two.assert_passed("check_micro_step_norms_fsdp2_equal_ddp")
    assert values[0]["fsdp2"][0] != values[1]["fsdp2"][0]  # micro-steps: each process's own gradients
    assert values[0]["fsdp2"][1] == values[1]["fsdp2"][1]  # sync steps: the global norm


def test_fsdp2_bf16_micro_step_norms(two):
    two.assert_passed("check_micro_step_norms_fsdp2_bf16")


def test_tp_micro_step_norms_equal_one_process(two):
    two.assert_passed("check_micro_step_norms_tp_equal_one_process")


def test_deepspeed_micro_step_norms(two):
    pytest.importorskip("deepspeed")
    two.assert_passed("check_micro_step_norms_deepspeed")


def test_dp_shard_times_tp_micro_step_norms():
    four = run_checks("checks_resume_state", world_size=4, only=["check_micro_step_norms_dp_shard_times_tp"])
    norms = four.assert_passed("check_micro_step_norms_dp_shard_times_tp")
    assert norms[0][0] == norms[1][0] != norms[2][0] == norms[3][0]  # tp pairs agree, dp ranks differ
    assert len({n[1] for n in norms}) == 1  # sync steps: the global norm


def _plain(with_optimizer=True, loaders=0, optimizer=torch.optim.AdamW):
    import checks_tp

    from hasten import Accelerator

    acc = Accelerator()
    model = checks_tp._mlp()
    objects = [model]
    if with_optimizer:
        objects.append(optimizer(model.parameters(), lr=0.01))
    for _ in range(loaders):
        objects.append(torch.utils.data.DataLoader(checks_tp._data(), batch_size=2, shuffle=True))
    prepared = acc.prepare(*objects)
    return acc, prepared if isinstance(prepared, tuple) else (prepared,)


def _caught(action):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        action()
    return [str(r.message) for r in records]


def test_sharded_checkpoint_loads_for_evaluation_in_one_plain_process(two, fresh_state):
    """FSDP2 on 2 processes, saved with a dataloader -> one process with a model and its optimizer only."""
    saved = two.assert_passed("check_fsdp2_checkpoint_for_evaluation")[0]
    acc, (model, opt) = _plain()
    messages = _caught(lambda: acc.load_state(saved["folder"]))
    got = model.state_dict()
    assert all(torch.equal(got[k], torch.tensor(v)) for k, v in saved["weights"].items())
    assert len(opt.state) == 6  # AdamW's moments came along (DCP reshards)
    assert any("dataloader 0" in m and "not restored" in m for m in messages), messages


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpoint_loads_for_evaluation_in_one_plain_process(two, fresh_state, stage):
    """ZeRO on 2 processes -> one plain process with model, optimizer and scheduler: the consolidated
    weights, fresh moments, and the learning rate the scheduler had set (not the constructor's)."""
    pytest.importorskip("deepspeed")
    from hasten import Accelerator

    name = "check_deepspeed_checkpoint_for_evaluation" if stage == 2 else "check_deepspeed_zero3_checkpoint_for_evaluation"
    saved = two.assert_passed(name)[0]
    import checks_tp

    acc = Accelerator()
    model = checks_tp._mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    model, opt, sched = acc.prepare(model, opt, sched)
    messages = _caught(lambda: acc.load_state(saved["folder"]))
    got = model.state_dict()
    assert all(torch.equal(got[k], torch.tensor(v)) for k, v in saved["weights"].items())
    assert any("optimizers start fresh" in m for m in messages), messages
    assert any("dataloader 0" in m and "not restored" in m for m in messages), messages
    assert opt.param_groups[0]["lr"] == saved["lr"] == sched.get_last_lr()[0] < 0.1


def test_dataloaders_the_run_has_are_restored_and_the_rest_named_once(tmp_path, fresh_state):
    """Saved with 2 loaders mid-epoch; loaded by runs with 0, 1 and 3: the ones present continue where
    they were, one warning (once per message) names the positions that were not restored."""
    from hasten.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    acc, (model, opt, first, second) = _plain(loaders=2)
    its = [iter(first), iter(second)]
    for it, n in zip(its, (2, 3)):
        for _ in range(n):
            next(it)
    acc.save_state(str(tmp_path / "ckpt"))
    expected = [next(its[0])[0], next(its[1])[0]]

    reset()
    acc, (model, opt) = _plain()
    messages = _caught(lambda: acc.load_state(str(tmp_path / "ckpt")))
    notes = [m for m in messages if "not restored" in m]
    assert len(notes) == 1 and "dataloaders 0 and 1" in notes[0], messages
    assert _caught(lambda: acc.load_state(str(tmp_path / "ckpt"))) == []  # once

    reset()
    acc, (model, opt, first) = _plain(loaders=1)
    messages = _caught(lambda: acc.load_state(str(tmp_path / "ckpt"), continue_dataloaders=True))
    assert torch.equal(next(iter(first))[0], expected[0])
    assert any("dataloader 1" in m and "not restored" in m for m in messages), messages

    reset()
    acc, (model, opt, first, second, third) = _plain(loaders=3)
    messages = _caught(lambda: acc.load_state(str(tmp_path / "ckpt"), continue_dataloaders=True))
    assert torch.equal(next(iter(first))[0], expected[0]) and torch.equal(next(iter(second))[0], expected[1])
    assert len(list(third)) == 12  # a whole epoch: it starts at the beginning
    assert any("dataloader 2" in m and "start" in m for m in messages), messages


def test_real_mismatches_are_still_refused(tmp_path, fresh_state):
    from hasten.saving import CheckpointMismatchError
    from hasten.state import AcceleratorState, GradientState

    acc, (model, opt, loader) = _plain(loaders=1)
    acc.save_state(str(tmp_path / "ckpt"))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc, (model,) = _plain(with_optimizer=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="it holds 1 prepared optimizers but this run has 0"):
        acc.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
