"""Data parallelism with ``torch.nn.parallel.DistributedDataParallel`` (CPU/gloo and GPU/NCCL)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import progress
from ..utils.dataclasses import DistributedDataParallelKwargs
from .base import Strategy
from .layout_steps import lay_out


class DDPStrategy(Strategy):
    """Replicate the model on every process and all-reduce gradients in backward.

    Reads the plan's ``DistributedDataParallelKwargs`` handler.
    """

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        self.distributed_type = plan.distributed_type
        self.ddp_kwargs = plan.handler(DistributedDataParallelKwargs) or DistributedDataParallelKwargs()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # DDP refuses frozen models; nothing to synchronise anyway (e.g. eval-only)
        lay_out(self.layout_target(model))  # inside DDP: its hooks stay outside the recomputed blocks
        device = self.state.device
        device_ids = [device.index] if device.type in ("cuda", "xpu") else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, output_device=device_ids[0] if device_ids else None,
                                      **self.ddp_kwargs.to_kwargs_for_ddp())
        self.ddp_kwargs.register_comm_hook(ddp)
        progress.ddp_wrapped()  # a hang in backward is then DDP's gradient all-reduce
        return ddp

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module):
        return model.no_sync() if isinstance(model, DistributedDataParallel) else super().no_sync(model)

    supports_join = True

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        before = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        # A backward inside no_sync() skipped the reducer's preparation; do it for this one.
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = before
