"""Save on preemption: SIGTERM (or chosen signals) -> checkpoint at a step boundary -> exit.

Cluster schedulers announce preemption with SIGTERM and kill a little later (torch's elastic agent
forwards SIGTERM to its workers and waits 30 s by default). The signal handler only records the
signal; the save happens at a *step boundary* of a prepared dataloader, i.e. when the training loop
asks for its next batch: the previous step is complete and the next batch has not been read, so
the checkpoint resumes exactly.

Agreement without collectives: processes may pass different numbers of boundaries (uneven
batches, evaluation loaders of different lengths), so a collective per boundary would be called
an unequal number of times and hang. Instead every boundary has a clock ``(pass, batch)``: the
number of passes over the watched loaders this process started, and the batches handed out in the
current one. The first process that sees a signal at a boundary publishes, through the process
group's key-value store, the target ``(pass, batch + gradient_accumulation_steps)``: no process can
be further ahead than that (processes meet in a gradient all-reduce at least once per
accumulation window), and every process reads the store at each boundary, so each learns the
target before passing it. The target is rounded up to the end of an accumulation window, so the
checkpoint holds no partial gradients (sharded strategies cannot save them). Every process saves at
its first boundary at or after the target (the start of the next pass when its current pass ends
before the target batch).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import warnings
from typing import Any, Iterable, Optional, Sequence

from ..warning_kinds import HastenWarning

_HANDLERS = itertools.count()  # handlers are installed in the same order on every process


class PreemptionHandler:
    """Installed by ``Accelerator.save_on_preemption``; see the module docstring."""

    def __init__(self, accelerator: Any, dataloaders: Sequence[Any], signals: Iterable[int], exit_code: int,
                 output_dir: Optional[str]) -> None:
        self.accelerator = accelerator
        self.dataloaders = list(dataloaders)
        for i, dl in enumerate(self.dataloaders):
            if not callable(getattr(dl, "add_boundary_callback", None)):  # it would never reach a boundary
                raise ValueError(f"save_on_preemption(dataloaders=...): item {i} is a {type(dl).__name__}, not a "
                                 "prepared dataloader; pass the dataloaders accelerator.prepare(...) returned")
        self.signals = [signal.Signals(s) for s in signals]
        self.exit_code = exit_code
        self.output_dir = output_dir
        self.received: Optional[int] = None
        self.saved: Optional[str] = None
        self.target: Optional[tuple[int, int]] = None
        self._previous: dict[int, Any] = {}
        self._passes = 0  # the pass part of the clock
        self._current: Optional[tuple[Any, int]] = None  # (loader, its pass number) of the last boundary
        self._key = f"hasten/preemption/{next(_HANDLERS)}"
        self._store = None
        if accelerator.use_distributed:
            from torch.distributed import distributed_c10d

            self._store = distributed_c10d._get_default_store()

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        for dl in self.dataloaders:
            dl.add_boundary_callback(self.at_boundary)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        for dl in self.dataloaders:
            dl.remove_boundary_callback(self.at_boundary)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: stop waiting for a boundary
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    def _clock(self, dataloader: Any) -> tuple[int, int]:
        this_pass = (dataloader, dataloader._passes)
        if self._current is None or self._current[0] is not this_pass[0] or self._current[1] != this_pass[1]:
            self._passes += 1
            self._current = this_pass
        return self._passes, int(dataloader._position)

    def _agree(self, clock: tuple[int, int]) -> Optional[tuple[int, int]]:
        """The target boundary once any process asked for it (no collective: one store read)."""
        accum = max(1, int(self.accelerator.gradient_accumulation_steps))
        if self._store is None:
            return self._window_end(clock, 0, accum) if self.received is not None else None
        if self.received is not None:
            mine = json.dumps(list(self._window_end(clock, accum, accum)))
            return tuple(json.loads(self._store.compare_set(self._key, "", mine)))  # the first proposal wins
        if self._store.check([self._key]):
            return tuple(json.loads(self._store.get(self._key)))
        return None

    @staticmethod
    def _window_end(clock: tuple[int, int], ahead: int, accum: int) -> tuple[int, int]:
        # Round up to the end of an accumulation window (windows start with each pass): sharded
        # strategies refuse mid-window saves, and no strategy then stores partial gradients.
        batch = clock[1] + ahead
        return clock[0], -(-batch // accum) * accum

    def requested(self) -> bool:
        """Whether a save was asked for (by a signal here or on another process)."""
        return self.target is not None or self.received is not None

    def at_boundary(self, dataloader: Any) -> None:
        clock = self._clock(dataloader)
        if self.target is None:
            self.target = self._agree(clock)
        if self.target is None or clock < self.target:
            return
        if clock[0] == self.target[0] and clock > self.target:  # ran apart without meeting in a collective
            warnings.warn(f"preemption: this process passed the agreed boundary {self.target} (at {clock}) "
                          "before learning it; saving here", HastenWarning, stacklevel=2)
        self.uninstall()
        acc = self.accelerator
        self.saved = acc.save_state(self.output_dir)
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another process"
        if acc.is_main_process:
            warnings.warn(f"preemption ({name}): saved {self.saved}; exiting with code {self.exit_code}",
                          HastenWarning, stacklevel=2)
        raise SystemExit(self.exit_code)
