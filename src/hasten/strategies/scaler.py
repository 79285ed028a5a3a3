"""The fp16 gradient scaler of sharded models: every process skips the same steps.

With sharded parameters (FSDP2) or split ones (tensor parallelism) each process holds different
pieces of the gradients, so an inf/NaN can show up on one process only; the scaler's verdict must
be agreed on, or one process would step and the other not, and their weights would part.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class AgreeingScaler(ShardedGradScaler):
    """A ``ShardedGradScaler`` (infs found on every shard, agreed on over the processes, so all of them
    skip the same steps) that also takes DTensor and plain gradients (layers outside a TP plan,
    FSDP's ignored modules) together: it checks them in separate calls, since one foreach call over
    both kinds is refused by DTensor."""

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict:
        def having(dtensor: bool) -> Any:
            return SimpleNamespace(param_groups=[
                {"params": [p for p in g["params"] if p.grad is not None and _is_dtensor(p.grad) == dtensor]}
                for g in optimizer.param_groups])

        kinds = {_is_dtensor(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        if len(kinds) < 2:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        found = dict(super()._unscale_grads_(having(True), inv_scale, found_inf, allow_fp16))
        for where, more in super()._unscale_grads_(having(False), inv_scale, found_inf, allow_fp16).items():
            found[where] = found[where] + more if where in found and found[where] is not more else more
        return found


def agreeing_scaler(scaler: Optional[torch.amp.GradScaler], device: torch.device) -> Optional[AgreeingScaler]:
    """``scaler``'s settings in an ``AgreeingScaler`` (None without fp16)."""
    if scaler is None:
        return None
    return AgreeingScaler(device.type, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                          backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
                          enabled=scaler.is_enabled())


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local")
