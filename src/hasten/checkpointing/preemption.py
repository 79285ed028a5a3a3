"""Save on preemption: SIGTERM (or chosen signals) -> checkpoint at the next step boundary -> exit.

Cluster schedulers announce preemption with SIGTERM and kill a little later (torch's elastic agent
forwards SIGTERM to its workers and waits 30 s by default). The signal handler only records the
signal; the save happens at the next *step boundary* of a prepared dataloader, i.e. when the
training loop asks for its next batch: the previous step (forward, backward, optimizer and
scheduler steps) is complete and the next batch has not been read, so the checkpoint resumes
exactly. With several processes they agree at every boundary (one tiny all-reduce on a CPU group)
so that all of them save at the same step, even if the signal reached them at different times.
"""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist


class PreemptionHandler:
    """Installed by ``Accelerator.save_on_preemption``; see the module docstring."""

    def __init__(self, accelerator: Any, dataloaders: Sequence[Any], signals: Iterable[int], exit_code: int,
                 output_dir: Optional[str]) -> None:
        self.accelerator = accelerator
        self.dataloaders = list(dataloaders)
        self.signals = [signal.Signals(s) for s in signals]
        self.exit_code = exit_code
        self.output_dir = output_dir
        self.received: Optional[int] = None
        self.saved: Optional[str] = None
        self._previous: dict[int, Any] = {}
        self._group = None
        if accelerator.use_distributed:
            # Agreement must not synchronise the GPU at every step: use a CPU (gloo) group.
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        for dl in self.dataloaders:
            dl.__dict__.setdefault("_boundary_callbacks", []).append(self.at_boundary)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        for dl in self.dataloaders:
            callbacks = dl.__dict__.get("_boundary_callbacks", [])
            if self.at_boundary in callbacks:
                callbacks.remove(self.at_boundary)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: stop waiting for a boundary
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    def requested(self) -> bool:
        """Whether any process received a signal (collective with several processes)."""
        flag = self.received is not None
        if self.accelerator.use_distributed:
            t = torch.tensor([int(flag)], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            flag = bool(t.item())
        return flag

    def at_boundary(self, dataloader: Any) -> None:
        if not self.requested():
            return
        self.uninstall()
        acc = self.accelerator
        self.saved = acc.save_state(self.output_dir)
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another process"
        if acc.is_main_process:
            warnings.warn(f"preemption ({name}): saved {self.saved}; exiting with code {self.exit_code}", stacklevel=2)
        raise SystemExit(self.exit_code)
