"""The ``Accelerator``'s tracking methods: ``init_trackers``, ``log``, ``get_tracker``.

No method here is a collective: a tracker that runs on the main process only is simply not
called elsewhere, so ``log`` on one rank and not on another can never hang the job.
"""

from __future__ import annotations

from typing import Any, Optional

from .base import GeneralTracker, InertRun, plain_log_values, warn_once


class TrackingMixin:
    """Experiment trackers selected by ``Accelerator(log_with=...)``."""

    log_with: list[Any]
    trackers: list[Any]
    _running_trackers: list[Any]

    def _select_trackers(self, log_with: Any) -> None:
        from .registry import filter_trackers

        say = (lambda message: print(f"hasten: {message}", flush=True)) if self.is_main_process else (lambda m: None)
        self.log_with = filter_trackers(log_with, self.logging_dir, say=say)
        self.trackers = []
        self._running_trackers = []

    def _runs_here(self, tracker: Any) -> bool:
        return not getattr(tracker, "main_process_only", True) or self.is_main_process

    def init_trackers(self, project_name: str, config: Optional[dict] = None,
                      init_kwargs: Optional[dict] = None) -> None:
        """Start a run named ``project_name`` in every tracker of ``log_with``.

        Args:
            project_name: the project / experiment / run name, as each tracker calls it.
            config: hyperparameters stored with the run (a dict or an ``argparse.Namespace``);
                values a tracker cannot store (tensors, objects) are converted, with a warning.
            init_kwargs: per tracker, keyword arguments for its constructor, e.g.
                ``{"wandb": {"tags": ["a"]}, "tensorboard": {"flush_secs": 30}}``.

        Only the processes a tracker runs on (the main process unless the tracker's
        ``main_process_only`` is False) create its run.
        """
        from .registry import LOGGER_TYPE_TO_CLASS

        if self.trackers:
            raise RuntimeError("init_trackers() was already called on this Accelerator; call it once per run "
                               "(end_training() finishes the current runs)")
        init_kwargs = dict(init_kwargs or {})
        selected = [t.name if isinstance(t, GeneralTracker) else str(t) for t in self.log_with]
        unused = sorted(set(init_kwargs) - set(selected))
        if unused:
            warn_once(f"init_trackers(init_kwargs=...) has settings for {unused}, which log_with does not select "
                      f"(selected: {selected})")
        for entry in self.log_with:
            if isinstance(entry, GeneralTracker):
                self.trackers.append(entry)
                continue
            cls = LOGGER_TYPE_TO_CLASS[str(entry)]
            args = (project_name, self.logging_dir) if cls.requires_logging_directory else (project_name,)
            self.trackers.append(cls(*args, **init_kwargs.get(str(entry), {})))
        for tracker in self.trackers:
            if self._runs_here(tracker):
                tracker.start()
                self._running_trackers.append(tracker)
        if config is not None:
            for tracker in self._running_trackers:
                tracker.store_init_configuration(config)

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        """Log ``values`` (name -> number, string, ...) at ``step`` to every running tracker.

        One-element tensors are logged as numbers. Processes where no tracker runs do nothing,
        and nothing here waits for other processes.
        """
        if not self._running_trackers:
            return
        values = plain_log_values(values)
        log_kwargs = log_kwargs or {}
        for tracker in self._running_trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (``unwrap=True``: its run object, e.g. the wandb run).

        On a process where that tracker does not run, ``unwrap=True`` returns an object whose
        methods do nothing, so calls on it need no ``is_main_process`` guard.
        """
        for tracker in self.trackers:
            if tracker.name == name:
                if not unwrap:
                    return tracker
                return tracker.tracker if tracker in self._running_trackers else InertRun(name)
        if self.trackers:
            raise ValueError(f"get_tracker({name!r}): no such tracker; the running ones are "
                             f"{[t.name for t in self.trackers]}")
        if self.log_with:
            raise ValueError(f"get_tracker({name!r}) was called before init_trackers(); start the trackers first")
        return GeneralTracker(_blank=True)  # tracking is off: a tracker that does nothing, as in Accelerate

    def _finish_trackers(self) -> None:
        """Finish every run this process started (all of them, even if one fails; then raise)."""
        running, self._running_trackers, self.trackers = self._running_trackers, [], []
        failure: Optional[BaseException] = None
        for tracker in running:
            try:
                tracker.finish()
            except Exception as error:  # noqa: BLE001 - finish the others first
                failure = failure or error
        if failure is not None:
            raise failure
