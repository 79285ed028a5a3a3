"""``LocalSGD``: train on each process alone for a few steps, then average the parameters.

Between averaging steps the prepared (DDP) model skips its gradient all-reduce, so each process
follows its own data; every ``local_sgd_steps`` calls of ``step()`` (and when the block ends)
the parameters are averaged over all processes, after which they are identical everywhere.
Communication drops by about ``local_sgd_steps`` times; the model drifts in between.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from .utils.dataclasses import DistributedType

_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_NPU,
              DistributedType.MULTI_MLU, DistributedType.MULTI_XPU, DistributedType.MULTI_MUSA,
              DistributedType.MULTI_HPU}


class LocalSGD:
    """Context manager for local SGD over a prepared model (Accelerate's ``LocalSGD``).

    Example::

        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in dataloader:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the prepared model.
        local_sgd_steps: steps between two averagings (>= 1).
        enabled: False turns it into a no-op (so does a single process).
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        kind = accelerator.distributed_type
        if kind not in _SUPPORTED:
            raise NotImplementedError(f"LocalSGD averages whole replicas, so it works with data parallelism only; "
                                      f"this run uses {kind}. Use plain training or drop LocalSGD")
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): use a whole number >= 1")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = bool(enabled) and accelerator.num_processes > 1
        self.num_steps = 0
        self._no_sync: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            no_sync = getattr(self.model, "no_sync", None)
            self._no_sync = no_sync() if no_sync is not None else contextlib.nullcontext()
            self._no_sync.__enter__()
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if not self.enabled:
            return
        try:
            if kind is None:  # after an error the other processes may not get here: averaging would hang
                self._average()
        finally:
            self._no_sync.__exit__(kind, value, traceback)

    def step(self) -> None:
        """Count one optimizer step; average the parameters every ``local_sgd_steps`` of them."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """Replace every parameter by its mean over processes (one all-reduce per dtype and device)."""
        import torch.distributed as dist

        groups: dict[tuple, list[torch.Tensor]] = {}
        for param in self.model.parameters():
            if not param.is_floating_point():  # integer parameters cannot be trained, nor averaged
                continue
            groups.setdefault((param.dtype, param.device), []).append(param.data)
        world = self.accelerator.num_processes
        for (dtype, _), tensors in groups.items():
            # Low-precision floats are summed in fp32 so that the mean is not rounded twice.
            wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
            flat = torch.cat([t.reshape(-1).to(wide) for t in tensors])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= world
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
