"""Profiling and LocalSGD on 2 processes (run inside every rank; see test_profile_local_sgd.py)."""

import json
import os

import torch
from torch import nn

from hasten import Accelerator
from hasten.local_sgd import LocalSGD
from hasten.utils import ProfileKwargs


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def check_profile_writes_one_trace_per_rank():
    out = os.path.join(os.environ["HASTEN_TEST_TMP"], "traces")
    acc = Accelerator(kwargs_handlers=[ProfileKwargs(output_trace_dir=out, record_shapes=True)])
    model = acc.prepare(_model())
    with acc.profile() as prof:
        model(torch.randn(3, 4, device=acc.device)).sum().backward()
    averages = prof.key_averages()
    # After the block every rank's trace exists (the block ends with a barrier, as in Accelerate).
    traces = {}
    for rank in range(acc.num_processes):
        with open(os.path.join(out, f"profile_{rank}.json")) as f:
            traces[rank] = len(json.load(f)["traceEvents"])
    leftovers = [n for n in os.listdir(out) if not n.startswith("profile_")]
    return {"events": traces, "ops": len(averages), "leftovers": leftovers}


def check_profile_schedule_and_handler_override():
    seen = []
    handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2}, on_trace_ready=lambda p: seen.append(1),
                            activities=["cpu"])
    acc = Accelerator()
    with acc.profile(handler) as prof:
        for _ in range(5):
            torch.randn(8, 8) @ torch.randn(8, 8)
            prof.step()
    return seen


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run_local_sgd(enabled, steps=7, every=3):
    acc = Accelerator()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    g = torch.Generator().manual_seed(100 + acc.process_index)  # different data on each rank
    rows = []
    with LocalSGD(acc, model, local_sgd_steps=every, enabled=enabled) as local_sgd:
        for _ in range(steps):
            x = torch.randn(16, 4, generator=g).to(acc.device)
            loss = (model(x).squeeze(-1) - x.sum(1)).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            before = acc.gather(_flat(model)[None])  # every rank's parameters before the step
            local_sgd.step()
            after = acc.gather(_flat(model)[None])
            rows.append({
                "spread": (after[0] - after[1]).abs().max().item(),
                "mean_error": (after[acc.process_index] - before.mean(0)).abs().max().item(),
            })
    end = acc.gather(_flat(model)[None])
    return {"rows": rows, "end_spread": (end[0] - end[1]).abs().max().item()}


def check_local_sgd_averages_every_k_steps():
    return _run_local_sgd(enabled=True)


def check_local_sgd_disabled_keeps_ddp_sync():
    return _run_local_sgd(enabled=False, steps=3)
