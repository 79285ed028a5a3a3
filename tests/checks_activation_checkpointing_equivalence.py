"""Activation checkpointing keeps the numbers of data-parallel training, inside each rank (see
test_activation_checkpointing_equivalence.py).

2 processes x batch B, each mode of activation checkpointing, under DDP and FSDP2, against plain
PyTorch on one process x batch 2B without checkpointing (the reference runs inside each rank, on the
sampler's interleaving of the batches). Three steps of a tiny Llama with gradient clipping and SGD (AdamW
would blow the sums' rounding up to ~1e-5 in the parameters of near-zero gradients):
the global loss of each step, the full gradients of the first step and the full parameters after the
last one are compared; each rank reports the worst absolute difference per mode.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from checks_activation_checkpointing import MODES, STRIP, _full, _handlers, _llama
from distributed import reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

B, SEQ, STEPS, VOCAB, CLIP, LR = 2, 16, 3, 64, 1.0, 0.5


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (2 * B * STEPS, SEQ), generator=g))


def _reference(device: torch.device) -> dict[str, torch.Tensor]:
    """One process, batch 2B (the two ranks' batches of a step, rank 0's first), no checkpointing."""
    model = _llama().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {}
    for step, (ids,) in enumerate(torch.utils.data.DataLoader(_data(), batch_size=2 * B)):
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[f"loss{step}"] = loss.detach().cpu().reshape(1)
        if step == 0:
            out.update({"g." + k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    out.update({"p." + k: v.detach().cpu() for k, v in model.state_dict().items()})
    return out


def _run(acc: Accelerator) -> tuple[dict[str, torch.Tensor], int]:
    """The same three steps through ``acc`` on 2 processes x B; the loss of each step is the mean
    of the ranks' (every rank has B x (SEQ - 1) labelled tokens, so it is the 2B batch's mean)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(_data(), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    out = {}
    for step, (ids,) in enumerate(loader):
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        out[f"loss{step}"] = acc.reduce(loss.detach(), reduction="mean").cpu().reshape(1)
        if step == 0:
            out.update({"g." + k.replace(STRIP, ""): _full(p.grad).detach().cpu().clone()
                        for k, p in acc.unwrap_model(model).named_parameters()})
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    out.update({"p." + k: v.cpu() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()})
    return out, sum(isinstance(m, CheckpointWrapper) for m in model.modules())


def _compare(make: Callable[[Optional[dict]], Accelerator], modes: dict) -> dict:
    """Worst absolute difference per mode from the one-process 2B reference and from the same
    strategy without checkpointing (``none``), and the number of checkpoint wrappers of each."""
    reset_state()
    want = _reference(make(None).device)
    worst, from_none, wrapped, steps = {}, {}, {}, {}
    plain, start = None, time.perf_counter()
    for name, setting in {"none": None, **modes}.items():
        reset_state()
        got, wrapped[name] = _run(make(setting))
        plain = plain or got
        worst[name], from_none[name] = _worst(got, want), _worst(got, plain)
        steps[name] = sum(k.startswith("loss") for k in got)
    return {"worst": worst, "from_none": from_none, "wrapped": wrapped, "steps": steps,
            "seconds": time.perf_counter() - start}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """The worst absolute difference of the losses, the first step's gradients and the final parameters."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for key in want:
        kind = "loss" if key.startswith("loss") else "grad" if key.startswith("g.") else "param"
        worst[kind] = max(worst[kind], float((got[key].float() - want[key].float()).abs().max()))
    return worst


def check_ddp():
    return _compare(lambda s: Accelerator(kwargs_handlers=_handlers(s)), MODES)


def _fsdp2(setting: Optional[dict]) -> Accelerator:
    flags = setting.pop("plugin_flags", {}) if setting else {}
    return Accelerator(fsdp_plugin=Plugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", **flags),
                       kwargs_handlers=_handlers(setting or None))


def check_fsdp2():
    """The handler's modes, and Accelerate's plugin flag (full checkpointing of the wrapped layers)."""
    return _compare(lambda s: _fsdp2(dict(s) if s else None),
                    {**MODES, "plugin_flag": {"plugin_flags": {"activation_checkpointing": True}}})
