"""Checkpoints under pipeline parallelism: the checks of checks_pipeline_ckpt.py on 2 real gloo
processes (pp_size=2), and the one-process ends of the conversions, in this process."""

import json
import os

import pytest
import torch

from distributed import reset_state, run_checks


def _step(acc, model, opt, sched, batches) -> float:
    """One plain (one-process) training step with clipping and the scheduler; its loss."""
    x, y = next(batches)
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss.detach())


def _single_run(folder: str) -> dict:
    """One process: 3 steps, save_state, 2 more steps; what a pp_size=2 load must reproduce."""
    import checks_pipeline_ckpt as c

    from hasten import Accelerator

    reset_state()
    acc = Accelerator(step_scheduler_with_optimizer=False)
    model = c._model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, loader, sched = acc.prepare(model, opt, c._loader(), sched)
    batches = iter(loader)

    for _ in range(3):
        _step(acc, model, opt, sched, batches)
    acc.save_state(folder)
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {"params": {k: v.tolist() for k, v in model.state_dict().items()},
                "moments": {f"{names[id(p)]}.{k}": v.tolist() for p, s in opt.state.items() for k, v in s.items()},
                "rest": [_step(acc, model, opt, sched, batches) for _ in range(2)]}
    reset_state()
    return expected


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppck"))
    single = os.path.join(tmp, "single")
    with open(os.path.join(tmp, "single.json"), "w") as f:
        json.dump(_single_run(single), f)
    report = run_checks("checks_pipeline_ckpt", world_size=2, timeout=300,
                        env={"PPCK_TMP": tmp, "PPCK_SINGLE": single})
    report.tmp = tmp
    return report


def test_mid_epoch_resume_at_pp2_is_exact(two):
    r = two.assert_passed("check_mid_epoch_resume")[0]
    assert r["layout"]["state_dict"] == "dcp" and r["layout"]["strategy"] == "PipelineStrategy"
    # each process wrote its own DCP shard file, inside the checksummed manifest
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata"} <= set(r["files"])


def test_pp2_checkpoint_loads_into_one_process(two, fresh_state):
    """pp_size=2 -> a plain model on 1 process: the same parameters and Adam state, then the same steps."""
    import checks_pipeline_ckpt as c

    from hasten import Accelerator

    r = two.assert_passed("check_mid_epoch_resume")[0]
    acc = Accelerator(step_scheduler_with_optimizer=False)
    model = c._model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, loader, sched = acc.prepare(model, opt, c._loader(), sched)
    acc.load_state(os.path.join(two.tmp, "resume"), continue_dataloaders=True)
    got = model.state_dict()
    assert set(got) == set(r["at_save"])
    assert all(torch.equal(got[k], torch.tensor(v)) for k, v in r["at_save"].items())
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {f"{names[id(p)]}.{k}": v for p, s in opt.state.items() for k, v in s.items()}
    assert set(moments) == set(r["moments"])
    assert all(torch.equal(moments[k], torch.tensor(v)) for k, v in r["moments"].items())
    assert opt.param_groups[0]["lr"] == r["lr"]
    batches = iter(loader)
    rest = []
    for _ in range(3):
        rest.append(_step(acc, model, opt, sched, batches))
    assert max(abs(a - b) for a, b in zip(rest, r["saved_losses"])) < 1e-6, (rest, r["saved_losses"])


def test_one_process_checkpoint_loads_at_pp2(two):
    assert len(two.assert_passed("check_single_process_checkpoint_into_pp")) == 2


def test_load_checkpoint_in_model_fills_each_stage(two):
    first, last = two.assert_passed("check_load_checkpoint_in_model")
    assert first == ["0.0.bias", "0.0.weight", "1.0.bias", "1.0.weight"]
    assert last == ["2.0.bias", "2.0.weight", "3.0.bias", "3.0.weight"]


def test_pp2_checkpoint_loads_under_fsdp2(two):
    saved = two.assert_passed("check_mid_epoch_resume")[0]
    for got in two.assert_passed("check_pp_checkpoint_into_fsdp2"):
        assert got["params"] == saved["at_save"]
        assert set(got["moments"]) == set(saved["moments"])
        assert all(got["moments"][k] == v for k, v in saved["moments"].items())
        assert got["lr"] == saved["lr"]


def test_interleaved_stages_and_two_parameter_groups_resume_exactly(two):
    for r in two.assert_passed("check_interleaved_two_groups_resume"):
        assert r["decay"] == [0.1, 0.0] and r["sizes"] == [2, 2]  # each process: 2 weights, 2 biases
        assert r["lrs"] == [1e-2 * 0.5, 5e-3 * 0.5]  # StepLR(step_size=2) after 3 steps


def test_save_inside_an_accumulation_window_is_refused(two):
    for r in two.assert_passed("check_save_inside_accumulation_window_is_refused"):
        assert "nothing was committed" in r["message"] and "pipeline stages" in r["message"] and "sync_gradients" in r["message"] and not r["written"]


def test_llama_weights_load_into_the_stages(two):
    first, last = two.assert_passed("check_llama_load_checkpoint_in_model")
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last and not set(first) & set(last)


def test_a_model_built_on_meta_fills_each_stage_from_weights_and_trains(two):
    for r in two.assert_passed("check_meta_built_llama_fills_from_weights_and_trains"):
        assert r["worst"] < 1e-5 and r["held"] > 0
        assert "built on the meta device have no values yet" in r["refused"], r["refused"]
        assert "load_checkpoint_in_model" in r["refused"]


def test_gpipe_checkpoint_loads_into_another_cut(two):
    saved = two.assert_passed("check_mid_epoch_resume")[0]
    for got in two.assert_passed("check_gpipe_checkpoint_into_interleaved"):
        assert got["params"] == saved["at_save"] and got["moments"] == saved["moments"] and got["lr"] == saved["lr"]


def test_checkpoint_of_another_model_is_refused_before_any_change(two):
    for message in two.assert_passed("check_checkpoint_of_another_model_changes_nothing"):
        assert "0.0.weight" in message and "shape" in message, message


def test_pp_times_dp_mid_epoch_resume_is_exact(tmp_path):
    report = run_checks("checks_pipeline_ckpt", world_size=4, timeout=400, env={"PPCK_TMP": str(tmp_path)},
                        only=["check_pp_times_dp_resume"])
    ranks = report.assert_passed("check_pp_times_dp_resume")
    assert ranks[0]["layout"]["mesh"]["pp"] == 2 and ranks[0]["layout"]["mesh"]["dp_replicate"] == 2
