"""Training-core checks, run inside every rank (1 and 2 processes). See distributed.py.

Each equivalence check computes its reference with plain PyTorch inside the same process, on the
whole global batch, so "2 processes x batch B" is compared with "1 process x batch 2B" directly.
"""

import copy
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration, GradScalerKwargs
from hasten.state import AcceleratorState, GradientState, PartialState

from devices import expected_device


def make_data(n=64, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def make_model(seed=1, d=6):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 1))


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def reference_training(dataset, global_batch, steps, device, lr=0.1, accumulate=1):
    """Plain PyTorch on ``device``: ``steps`` SGD updates, each on ``accumulate`` consecutive global batches."""
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = (t.to(device) for t in dataset.tensors)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            start = (step * accumulate + micro) * global_batch
            loss = loss_fn(model, x[start:start + global_batch], y[start:start + global_batch]) / accumulate
            loss.backward()
        opt.step()
    return model


def max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _train(accelerator, dataset, loader_batch, steps, accumulate=False, lr=0.1):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dl = DataLoader(dataset, batch_size=loader_batch, shuffle=False)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    updates = 0
    for x, y in dl:
        if accumulate:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, x, y))
                opt.step()
                opt.zero_grad()
                updates += int(accelerator.sync_gradients)
        else:
            accelerator.backward(loss_fn(model, x, y))
            opt.step()
            opt.zero_grad()
            updates += 1
        if updates == steps and accelerator.sync_gradients:
            break
    return accelerator.unwrap_model(model), updates


def check_ddp_matches_single_process_big_batch():
    acc = Accelerator()
    world, B, steps = acc.num_processes, 4, 5
    data = make_data(n=B * world * steps)
    trained, updates = _train(acc, data, B, steps)
    ref = reference_training(data, B * world, steps, acc.device)
    diff = max_param_diff(trained, ref)
    assert updates == steps and diff < 1e-6, (updates, diff)
    return diff


def check_split_batches_matches_single_process():
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
    world, B, steps = acc.num_processes, 4, 5
    data = make_data(n=B * world * steps)
    trained, _ = _train(acc, data, B * world, steps)  # loader batch is the global batch
    diff = max_param_diff(trained, reference_training(data, B * world, steps, acc.device))
    assert diff < 1e-6, diff
    return diff


def check_accumulation_matches_big_batch():
    acc = Accelerator(gradient_accumulation_steps=4)
    world, B, steps = acc.num_processes, 2, 3
    data = make_data(n=B * world * 4 * steps)
    trained, updates = _train(acc, data, B, steps, accumulate=True)
    ref = reference_training(data, B * world * 4, steps, acc.device)
    diff = max_param_diff(trained, ref)
    assert updates == steps and diff < 1e-5, (updates, diff)
    return diff


def check_accumulation_skips_allreduce_until_sync():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = acc.prepare(model, opt)
    rank = acc.process_index
    x = torch.full((2, 6), float(rank + 1), device=acc.device)
    y = torch.zeros(2, device=acc.device)
    seen = []
    for _ in range(2):
        with acc.accumulate(model):
            acc.backward(loss_fn(model, x, y))
            grad = acc.unwrap_model(model)[0].weight.grad.clone()
            seen.append((acc.sync_gradients, acc.gather(grad.unsqueeze(0))))
            opt.step()
            opt.zero_grad()
    (sync0, g0), (sync1, g1) = seen
    assert sync0 is False and sync1 is True
    if acc.num_processes == 2:
        assert not torch.allclose(g0[0], g0[1]), "micro-step gradients were all-reduced"
        assert torch.allclose(g1[0], g1[1]), "sync-step gradients differ across ranks"
    return [sync0, sync1]


def check_accumulation_syncs_at_end_of_dataloader():
    acc = Accelerator(gradient_accumulation_steps=4)
    dl = DataLoader(make_data(n=6 * acc.num_processes), batch_size=1)
    model, opt, dl = acc.prepare(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), dl)
    flags = []
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(loss_fn(model, x, y))
            flags.append(acc.sync_gradients)
    assert flags == [False, False, False, True, False, True], flags
    return flags


def check_optimizer_and_scheduler_follow_sync_steps():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = torch.ones(2, 6, device=acc.device), torch.zeros(2, device=acc.device)
    lrs = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(loss_fn(model, x, y))
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append(sched.get_last_lr()[0])
    # Two optimizer steps; each advances the schedule once per process (Accelerate's rule).
    n = acc.num_processes
    expected = [1.0, 0.5 ** n, 0.5 ** n, 0.5 ** (2 * n)]
    assert lrs == expected, (lrs, expected)
    return lrs


def check_fp16_overflow_skips_step_and_scheduler():
    # Plain SGD (the scaler calls step only for finite gradients), fused AdamW (its step receives the
    # scaler's found_inf and skips inside), and fused AdamW unscaled earlier by clip_grad_norm_.
    kinds = {
        "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
        "fused adamw": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
        "fused adamw, clipped": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    }
    scales = {}
    for kind, make in kinds.items():
        AcceleratorState._reset_state()
        GradientState._reset_state()
        # A modest initial scale keeps honest gradients finite in fp16; the overflow is forced below.
        acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
        model = nn.Linear(4, 1)
        opt = make(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model, opt, sched = acc.prepare(model, opt, sched)
        x = torch.ones(2, 4, device=acc.device)
        before = [p.detach().clone() for p in model.parameters()]
        scale_before = acc.scaler.get_scale()
        loss = model(x).sum() * (float("inf") if acc.is_main_process else 1.0)
        acc.backward(loss)
        if "clipped" in kind:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        assert acc.optimizer_step_was_skipped, f"{kind}: overflow did not skip the step"
        after = [p.detach() for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{kind}: parameters changed on an overflow step"
        assert sched.get_last_lr() == [0.1], (kind, sched.get_last_lr())
        assert acc.scaler.get_scale() < scale_before, kind
        # A finite step afterwards goes through.
        acc.backward(model(x).sum())
        if "clipped" in kind:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        assert not acc.optimizer_step_was_skipped, kind
        assert not all(torch.equal(a, b) for a, b in zip(before, [p.detach() for p in model.parameters()])), kind
        assert sched.get_last_lr() == [0.1 * 0.5 ** acc.num_processes], (kind, sched.get_last_lr())
        scales[kind] = acc.scaler.get_scale()
    return scales


def check_bf16_trains():
    acc = Accelerator(mixed_precision="bf16")
    data = make_data(n=128)
    model = make_model()
    model, opt, dl = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                 DataLoader(data, batch_size=16, shuffle=True))
    losses = []
    for _ in range(16):
        total = 0.0
        for x, y in dl:
            out = model(x)
            assert out.dtype == torch.float32, out.dtype  # outputs come back in fp32
            loss = nn.functional.mse_loss(out.squeeze(-1), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            total += loss.item()
        losses.append(total)
    with acc.autocast():  # autocast covers tensors of the accelerator's device only
        inner = torch.ones(2, 2, device=acc.device) @ torch.ones(2, 2, device=acc.device)
    assert inner.dtype == torch.bfloat16
    assert losses[-1] < 0.5 * losses[0], losses
    return losses


def check_fp16_scales():
    acc = Accelerator(mixed_precision="fp16")
    assert acc.scaler is not None and acc.scaler.is_enabled()
    model, opt = acc.prepare(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1))
    out = model(torch.ones(2, 4, device=acc.device))
    assert out.dtype == torch.float32
    with acc.autocast():
        ones = torch.ones(2, 2, device=acc.device)
        assert (ones @ ones).dtype == torch.float16
    return acc.scaler.get_scale()


def check_clip_grad_norm_unscales_once():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    model = nn.Linear(4, 1)
    ref = copy.deepcopy(model).to(acc.device)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.arange(8.0, device=acc.device).view(2, 4)
    acc.backward(model(x).sum())
    (ref(x).sum()).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)  # true norm, no clipping
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    again = acc.clip_grad_norm_(model.parameters(), 1.0)  # no second unscale, no error
    assert math.isclose(norm.item(), expected.item(), rel_tol=1e-3), (norm.item(), expected.item())
    assert again.item() <= 1.0 + 1e-4
    acc.clip_grad_value_(model.parameters(), 0.01)
    assert all(p.grad.abs().max() <= 0.01 + 1e-7 for p in model.parameters())
    opt.step()
    assert not acc.optimizer_step_was_skipped
    return norm.item()


def check_clip_skipped_on_micro_steps():
    import warnings

    acc = Accelerator(gradient_accumulation_steps=2)
    model, opt = acc.prepare(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1))
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            with acc.accumulate(model):
                acc.backward(model(torch.ones(2, 4, device=acc.device)).sum())
                results.append(acc.clip_grad_norm_(model.parameters(), 1.0))
    # a micro-step clips nothing but still returns a norm (scripts log norm.item() on every step)
    assert all(isinstance(r, torch.Tensor) for r in results)
    return True


def check_prepare_is_idempotent_and_ordered():
    acc = Accelerator()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    dl = DataLoader(make_data(n=8), batch_size=2)
    thing = {"not": "prepared"}
    p_dl, p_model, p_thing, p_opt, p_sched = acc.prepare(dl, model, thing, opt, sched)
    assert p_thing is thing
    assert acc.prepare(p_model) is p_model and acc.prepare(model) is p_model
    assert acc.prepare(p_opt) is p_opt and acc.prepare(opt) is p_opt
    assert acc.prepare(p_sched) is p_sched and acc.prepare(p_dl) is p_dl
    assert len(acc._models) == 1 and len(acc._optimizers) == 1
    assert isinstance(p_opt, torch.optim.Optimizer)
    wrapped = type(p_model).__name__
    expected = "DistributedDataParallel" if acc.num_processes > 1 else "Sequential"
    assert wrapped == expected, wrapped
    assert acc.unwrap_model(p_model) is model
    return wrapped


def check_triggers():
    acc = Accelerator()
    assert acc.check_trigger() is False
    if acc.is_last_process:
        acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False
    return True


def check_properties():
    acc = Accelerator()
    s = PartialState()
    assert acc.device == expected_device(s.local_process_index), (acc.device, expected_device(s.local_process_index))
    assert acc.num_processes == s.num_processes
    assert acc.process_index == s.process_index
    assert acc.mixed_precision == "no" and acc.gradient_accumulation_steps == 1
    assert acc.sync_gradients is True and acc.optimizer_step_was_skipped is False
    expected = ("MULTI_GPU" if acc.device.type == "cuda" else "MULTI_CPU") if s.num_processes > 1 else "NO"
    assert str(acc.distributed_type) == expected
    calls = []
    acc.on_main_process(lambda: calls.append("main"))()
    acc.on_last_process(lambda: calls.append("last"))()
    acc.on_process(lambda: calls.append("p1"), process_index=1)()
    return calls


def check_save_model_from_ddp():
    import os

    from hasten.model_loading import load_checkpoint_in_model

    acc = Accelerator()
    model, = [acc.prepare(make_model())]
    path = os.path.join(os.environ["HASTEN_TEST_TMP"], f"saved-{acc.num_processes}")
    acc.save_model(model, path)
    acc.wait_for_everyone()
    fresh = make_model(seed=7)
    load_checkpoint_in_model(fresh, path)
    fresh.to(acc.device)
    assert max_param_diff(fresh, acc.unwrap_model(model)) == 0
    return sorted(os.listdir(path))


def check_ddp_kwargs_and_eval_gather():
    from hasten import DistributedDataParallelKwargs

    acc = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model = acc.prepare(make_model())
    if acc.num_processes > 1:
        assert model.find_unused_parameters is True
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(7.0)), batch_size=2))
    seen = []
    for (x,) in dl:
        seen += acc.gather_for_metrics(x).tolist()
    assert sorted(seen) == list(range(7)), seen
    return seen


def check_print_and_local_main_first():
    import io
    from contextlib import redirect_stdout

    acc = Accelerator()
    buf = io.StringIO()
    with redirect_stdout(buf):
        acc.print("hello from", acc.process_index)
    with acc.local_main_process_first():
        pass
    expected = "hello from 0\n" if acc.is_local_main_process else ""
    assert buf.getvalue() == expected, buf.getvalue()
    return buf.getvalue()


def check_free_memory_drops_references():
    acc = Accelerator()
    model, opt = acc.prepare(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
    acc.free_memory()
    assert acc._models == [] and acc._optimizers == [] and acc.step == 0
    return True


def check_zz_end_training_tears_down():
    # Runs last in its launch (checks run in file order): it destroys the process group.
    import torch.distributed as dist

    acc = Accelerator()
    acc.end_training()
    assert not (dist.is_available() and dist.is_initialized())
    acc.end_training()  # idempotent
    return True
