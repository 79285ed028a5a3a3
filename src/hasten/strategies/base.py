"""The interface every parallel strategy implements.

A strategy decides how a model is spread over processes: wrapping, skipping gradient sync on
accumulation steps, clipping, and producing/consuming a full state dict. Data loading and
checkpointing talk to this interface only, so adding FSDP2 or DeepSpeed adds a module here and
touches nothing else.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from ..state import PartialState
from ..utils.dataclasses import DistributedType

Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def foreign_wrapper(model: nn.Module) -> Optional[str]:
    """The name of a parallel wrapper already around ``model``, if any (by class, no imports)."""
    names = {cls.__name__ for cls in type(model).__mro__}
    for name in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule",
                 "DeepSpeedEngine", "PipelineEngine"):
        if name in names:
            return name
    return None


class Strategy:
    """Single-process behaviour; subclasses override what differs."""

    distributed_type = DistributedType.NO

    def __init__(self, state: PartialState, **options: Any) -> None:
        self.state = state
        self.options = options

    # -- the model ------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return the model as it should be trained (``model`` is already on the device)."""
        return model

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever ``wrap_model`` returned."""
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hook for strategies that must rebuild the optimizer around sharded parameters."""
        return optimizer

    # -- a training step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward does not synchronise gradients across processes."""
        return contextlib.nullcontext()

    # Whether torch's Join (``Accelerator.join_uneven_inputs``) works with this strategy's models.
    supports_join = False

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward synchronises gradients, even inside ``no_sync``."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def grad_norm(self, parameters: Params, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of the gradients of ``parameters`` as they are now, changing nothing."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Params, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- state dict I/O -------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict of the unwrapped model (every process gets it)."""
        return self.unwrap_model(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        return self.unwrap_model(model).load_state_dict(state_dict, strict=strict)
