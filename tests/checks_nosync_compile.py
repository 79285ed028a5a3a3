"""accumulate()/no_sync() of a compiled prepared model, inside each of 2 ranks (see distributed.py):
the gradient collectives happen once per accumulation window, as without compilation."""

import torch
import torch.distributed as dist
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

STEPS = 4  # micro-steps per accumulation window


def _counting_hook(calls: list, bucket):
    """DDP comm hook: the default averaging all-reduce, counted."""
    calls.append(1)
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _ddp_allreduces(backend, windows: int = 2) -> list:
    """The gradient all-reduces DDP ran in each accumulation window of ``STEPS`` micro-steps."""
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=STEPS, dynamo_backend=backend)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    calls: list = []
    ddp = acc.unwrap_model(model, keep_torch_compile=False)  # the user's module; its DDP holds the hook
    wrapper = model._orig_mod if hasattr(model, "_orig_mod") else model
    assert isinstance(wrapper, nn.parallel.DistributedDataParallel), type(wrapper)
    wrapper.register_comm_hook(calls, _counting_hook)
    per_window = []
    for _ in range(windows):
        before = len(calls)
        for _ in range(STEPS):
            with acc.accumulate(model):
                x = torch.full((2, 3), float(acc.process_index + 1), device=acc.device)
                acc.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
        per_window.append(len(calls) - before)
    assert ddp is wrapper.module
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()]).tolist()
    return {"per_window": per_window, "weights": weights}


def check_ddp_eager_counts_one_allreduce_per_window():
    return _ddp_allreduces(None)


def check_ddp_compiled_counts_one_allreduce_per_window():
    return _ddp_allreduces("eager")


def check_ddp_compiled_no_sync_and_trigger_sync():
    """no_sync() of the compiled model skips the all-reduce; trigger_sync_in_backward() forces it."""
    reset_state()
    acc = Accelerator(dynamo_backend="eager")
    torch.manual_seed(0)
    model = acc.prepare(nn.Linear(3, 1))
    calls: list = []
    model._orig_mod.register_comm_hook(calls, _counting_hook)
    x = torch.full((2, 3), float(acc.process_index + 1), device=acc.device)
    with acc.no_sync(model):
        acc.backward(model(x).sum())
        skipped = len(calls)
        with acc.trigger_sync_in_backward(model):
            acc.backward(model(x).sum())
        forced = len(calls) - skipped
    return [skipped, forced]


def _fsdp2_reduced(backend) -> list:
    """Per micro-step of one window: whether a reduce-scatter delivered sharded gradients (FSDP2
    leaves ``.grad`` None while ``set_requires_gradient_sync(False)`` holds)."""
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=STEPS, dynamo_backend=backend,
                      fsdp_plugin=Plugin(fsdp_version=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    reduced = []
    for _ in range(STEPS):
        with acc.accumulate(model):
            x = torch.full((2, 3), float(acc.process_index + 1), device=acc.device)
            acc.backward(model(x).sum())
            reduced.append(any(p.grad is not None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
    return reduced


def check_fsdp2_eager_micro_steps_keep_grads_unreduced():
    return _fsdp2_reduced(None)


def check_fsdp2_compiled_micro_steps_keep_grads_unreduced():
    return _fsdp2_reduced("eager")


def check_deepspeed_clip_without_gradient_clipping_names_the_flag():
    """Issue 24 item 2: ZeRO-2 and a loop that calls ``clip_grad_norm_(params, 1.0)`` trains without
    ``gradient_clipping`` (the call sets the engine's clipping) and with the variable that
    ``--gradient_clipping 1.0`` sets; a ValueError would be recorded as its message."""
    from checks_fsdp import _data, _model
    from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

    import os

    seen = {}
    for clip in (None, 1.0):
        reset_state()
        if clip is not None:  # what `hasten launch --gradient_clipping 1.0` sets
            os.environ["HASTEN_GRADIENT_CLIPPING"] = str(clip)
        try:
            acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
        finally:
            os.environ.pop("HASTEN_GRADIENT_CLIPPING", None)
        model = _model()
        model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         torch.utils.data.DataLoader(_data(), batch_size=2))
        try:
            for x, y in loader:
                acc.backward(nn.functional.mse_loss(model(x), y))
                norm = acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            seen[str(clip)] = float(norm) > 0
        except ValueError as e:
            seen[str(clip)] = str(e)
        acc.free_memory()
    return seen
