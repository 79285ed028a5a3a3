"""Optimizer hyperparameters across a resume, gradient norms on accumulation micro-steps, and
checkpoints written for other runs, inside each rank of 2 processes (see distributed.py and
test_resume_state.py). Every check runs its layouts in the same processes, so DDP, FSDP2 and tensor
parallelism are judged against each other on the same numbers."""

import os

import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from hasten.utils.parallelism_config import ParallelismConfig

# A model with a tensor-parallel plan, so the same model runs under every layout.
from checks_tp import MLP_PLAN, _data, _mlp  # noqa: E402


def _accelerator(kind: str, accum: int = 1, mixed_precision: str = "no") -> Accelerator:
    reset_state()
    if kind == "ddp":
        return Accelerator(gradient_accumulation_steps=accum, mixed_precision=mixed_precision)
    if kind == "fsdp2":
        return Accelerator(fsdp_plugin=Plugin(fsdp_version=2), gradient_accumulation_steps=accum,
                           mixed_precision=mixed_precision)
    if kind == "tp":
        return Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_plan=MLP_PLAN),
                           gradient_accumulation_steps=accum, mixed_precision=mixed_precision)
    raise ValueError(kind)


def _full(acc, model) -> dict:
    return {k: v.clone() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}


def _step(acc, model, opt, batch) -> None:
    x, y = batch
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def _sgd_run(kind):
    acc = _accelerator(kind)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    return acc, *acc.prepare(model, opt, sched, loader)


def _sgd_lr_resume(kind):
    """Plain SGD (no state at all) with a StepLR: the lr must come back with the scheduler."""
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], f"sgd_{kind}")
    acc, model, opt, sched, loader = _sgd_run(kind)
    batches = iter(loader)
    for _ in range(2):
        _step(acc, model, opt, next(batches))
        sched.step()
    saved_lr = opt.param_groups[0]["lr"]
    acc.save_state(folder)
    _step(acc, model, opt, next(batches))
    expected = _full(acc, model)
    acc, model, opt, sched, loader = _sgd_run(kind)
    acc.load_state(folder, continue_dataloaders=True)
    lr, last = opt.param_groups[0]["lr"], sched.get_last_lr()[0]
    assert lr == saved_lr == last, f"{kind}: lr {lr} after load_state, {saved_lr} at save, scheduler says {last}"
    _step(acc, model, opt, next(iter(loader)))  # the loader resumes at the batch after the save
    got = _full(acc, model)
    worst = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    assert worst < 1e-6, (kind, worst)
    return {"lr": lr, "worst": worst}


def check_sgd_lr_resumes_ddp():
    return _sgd_lr_resume("ddp")


def check_sgd_lr_resumes_fsdp2():
    return _sgd_lr_resume("fsdp2")


def check_sgd_lr_resumes_tp():
    return _sgd_lr_resume("tp")


def _adam_run(kind):
    acc = _accelerator(kind)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** (step + 1))  # lr 0.05 from the start
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    return acc, *acc.prepare(model, opt, sched, loader)


def _adam_before_first_step(kind):
    """Adam saved before its first step (no state yet), loaded into a run whose Adam already stepped:
    the lr comes back and the moments are gone, as torch's load_state_dict does; the next step then
    equals the one the saving run took (a step count of 1 left behind would change it)."""
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], f"adam_{kind}")
    acc, model, opt, sched, loader = _adam_run(kind)
    saved_lr = opt.param_groups[0]["lr"]
    acc.save_state(folder)
    batch = next(iter(loader))
    _step(acc, model, opt, batch)
    expected = _full(acc, model)
    acc, model, opt, sched, loader = _adam_run(kind)
    for _ in range(2):
        _step(acc, model, opt, batch)
        sched.step()
    assert opt.param_groups[0]["lr"] != saved_lr and len(opt.state) > 0
    acc.load_state(folder)
    lr = opt.param_groups[0]["lr"]
    assert lr == saved_lr, f"{kind}: lr {lr} after load_state, {saved_lr} at save"
    assert len(opt.state) == 0, f"{kind}: {len(opt.state)} parameters kept optimizer state the checkpoint did not hold"
    _step(acc, model, opt, batch)
    got = _full(acc, model)
    worst = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    assert worst < 1e-6, (kind, worst)
    return {"lr": lr, "worst": worst}


def check_adam_before_first_step_ddp():
    return _adam_before_first_step("ddp")


def check_adam_before_first_step_fsdp2():
    return _adam_before_first_step("fsdp2")


def check_adam_before_first_step_tp():
    return _adam_before_first_step("tp")


def check_micro_step_norms_deepspeed():
    """ZeRO-1 keeps each process's gradients until the sync step: its micro-step norms equal DDP's.
    ZeRO-2 reduces and partitions them in backward: 0.0 on micro-steps, with a warning saying why."""
    import warnings

    from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

    ddp, _ = _micro_norms("ddp")
    out = {}
    for stage in (1, 2):
        reset_state()
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, gradient_clipping=0.5),
                          gradient_accumulation_steps=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            norms, _ = _micro_norms(f"zero{stage}", acc=acc, check_micro=stage == 1)
        out[stage] = norms
        assert all(abs(a - b) <= 1e-5 * max(1.0, b) for a, b in zip(norms[1::2], ddp[1::2])), (stage, norms, ddp)
        said = any(f"ZeRO-{stage} returns 0.0" in str(w.message) for w in caught)
        if stage == 1:
            assert all(abs(a - b) <= 1e-5 * max(1.0, b) for a, b in zip(norms, ddp)) and not said, (norms, ddp)
        else:
            assert norms[::2] == [0.0, 0.0, 0.0] and said, (norms, [str(w.message) for w in caught])
        acc.free_memory()
    return out


def _micro_norms(kind, mixed_precision="no", acc=None, check_micro=True):
    """``clip_grad_norm_`` on every step of 2-step accumulation (the value a user logs each step),
    and for each window's first micro-step what one process computes from the same weights and
    batch: the norm of that batch's gradient (the loss divided by the 2 steps)."""
    acc = acc or _accelerator(kind, accum=2, mixed_precision=mixed_precision)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    norms, own = [], []
    for i, (x, y) in enumerate(loader):
        if i == 6:
            break
        if i % 2 == 0:
            plain = _mlp()
            plain.load_state_dict(_full(acc, model))
            (nn.functional.mse_loss(plain(x), y) / 2).backward()
            own.append(float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])))
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
    tolerance = 1e-5 if mixed_precision == "no" else 2e-2  # bf16 compute vs the fp32 process
    assert not check_micro or all(abs(a - b) <= tolerance * max(1.0, b) for a, b in zip(norms[::2], own)), \
        (kind, norms[::2], own)
    return norms, _full(acc, model)


def check_micro_step_norms_fsdp2_equal_ddp():
    """Each process gets the norm of the gradients it accumulated so far, as under DDP; the sync
    steps (clipped at 0.5) train the same weights."""
    ddp, ddp_weights = _micro_norms("ddp")
    fsdp, fsdp_weights = _micro_norms("fsdp2")
    assert all(n > 0 for n in fsdp), fsdp
    assert all(abs(a - b) <= 1e-6 * max(1.0, b) for a, b in zip(fsdp, ddp)), (fsdp, ddp)
    worst = max(float((fsdp_weights[k] - ddp_weights[k]).abs().max()) for k in ddp_weights)
    assert worst < 1e-6, worst
    return {"fsdp2": fsdp, "ddp": ddp}


def check_micro_step_norms_fsdp2_bf16():
    """bf16 FSDP2 accumulates in fp32 buffers of its own on micro-steps: the norm is read there."""
    ddp, _ = _micro_norms("ddp", "bf16")
    fsdp, _ = _micro_norms("fsdp2", "bf16")
    assert all(n > 0 for n in fsdp), fsdp
    assert all(abs(a - b) <= 2e-2 * b for a, b in zip(fsdp, ddp)), (fsdp, ddp)
    return {"fsdp2": fsdp, "ddp": ddp}


def check_micro_step_norms_tp_equal_one_process():
    """Tensor parallelism alone: every process sees the whole batch, so every step's norm (micro-step
    or not) is the one process's norm of the same accumulated gradients."""
    tp, _ = _micro_norms("tp")
    model = _mlp()
    expected = []
    for i, (x, y) in enumerate(list(torch.utils.data.DataLoader(_data(), batch_size=2))[:6]):
        (nn.functional.mse_loss(model(x), y) / 2).backward()
        grads = [p.grad for p in model.parameters()]
        expected.append(float(torch.nn.utils.get_total_norm(grads)))
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            model.zero_grad()
    assert all(abs(a - b) <= 1e-5 * max(1.0, b) for a, b in zip(tp, expected)), (tp, expected)
    return {"tp": tp, "expected": expected}


def check_fsdp2_checkpoint_for_evaluation():
    """Written here, loaded by the test into one plain process that prepared no dataloader."""
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "fsdp_eval")
    acc = _accelerator("fsdp2")
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches = iter(loader)
    for _ in range(2):
        _step(acc, model, opt, next(batches))
    acc.save_state(folder)
    return {"folder": folder, "weights": {k: v.tolist() for k, v in _full(acc, model).items()}}


def _deepspeed_checkpoint(stage):
    """A ZeRO checkpoint of SGD + StepLR after 2 steps, for the test to load into one plain process
    that prepared no dataloader: its weights, and the lr the scheduler had set."""
    from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], f"ds_eval_{stage}")
    reset_state()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    batches = iter(loader)
    for _ in range(2):
        _step(acc, model, opt, next(batches))
        sched.step()
    acc.save_state(folder)
    weights = {k: v.tolist() for k, v in acc.get_state_dict(model).items()}
    lr = opt.param_groups[0]["lr"]
    acc.free_memory()
    return {"folder": folder, "weights": weights, "lr": lr}


def check_deepspeed_checkpoint_for_evaluation():
    return _deepspeed_checkpoint(2)


def check_deepspeed_zero3_checkpoint_for_evaluation():
    return _deepspeed_checkpoint(3)


def check_micro_step_norms_dp_shard_times_tp():
    """4 processes, FSDP2 over 2 x tensor parallel over 2: on micro-steps each process's unreduced
    gradient, whole over its tp pair (checked inside against one process on the same batch)."""
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2, tp_plan=MLP_PLAN),
                      fsdp_plugin=Plugin(fsdp_version=2), gradient_accumulation_steps=2)
    norms, _ = _micro_norms("dp_shard x tp", acc=acc)
    return norms
