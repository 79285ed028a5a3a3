"""Trackers that write local files: TensorBoard, Aim, DVCLive and Trackio.

Each imports its package in ``start`` only. The constructor arguments and the ``init_kwargs``
they accept are Accelerate's: ``init_kwargs={"tensorboard": {...}}`` goes to the tracker's
constructor and from there to the package.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .base import GeneralTracker, RunTracker, on_main_process, scalar_or_none, storable_config, warn_once


def _dropped(tracker: str, key: str, value: Any, accepts: str) -> None:
    warn_once(f"{tracker}: value of {key!r} ({type(value).__name__}) was not logged; {tracker} accepts {accepts}")


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files in ``<logging_dir>/<run_name>`` (``torch.utils.tensorboard``, else tensorboardX).

    Numbers become scalars, strings text, dicts of numbers one chart with several lines.
    ``kwargs`` go to ``SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True
    package, module = "tensorboard", "tensorboard"

    def __init__(self, run_name: str, logging_dir: Any, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package; tensorboardX stands alone
            from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Hyperparameters for TensorBoard's HParams view, and ``hparams.yml`` beside the events."""
        import yaml

        from ..saving import atomic_write

        plain = storable_config(values, self.name, flat=True)
        # add_hparams takes numbers, strings and bools only.
        hparams = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in plain.items()}
        self.writer.add_hparams(hparams, metric_dict={})
        self.writer.flush()
        os.makedirs(self.logging_dir, exist_ok=True)
        with atomic_write(os.path.join(self.logging_dir, "hparams.yml"), "w") as f:
            yaml.safe_dump(storable_config(values, self.name), f)

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if scalar_or_none(value) is not None:
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict) and all(scalar_or_none(v) is not None for v in value.values()):
                self.writer.add_scalars(key, {k: scalar_or_none(v) for k, v in value.items()}, global_step=step, **kwargs)
            else:
                _dropped(self.name, key, value, "numbers, strings and dicts of numbers")
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """``values``: name -> a batch of images (NCHW by default; ``dataformats="NHWC"`` in kwargs)."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class AimTracker(GeneralTracker):
    """An Aim run in the repository at ``logging_dir``; ``kwargs`` go to ``aim.Run``."""

    name = "aim"
    requires_logging_directory = True
    package, module = "aim", "aim"

    def __init__(self, run_name: str, logging_dir: Any = ".", **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.aim_repo_path = os.fspath(logging_dir)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        from aim import Run

        self.writer = Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer["hparams"] = storable_config(values, self.name)

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        import aim

        for key, value in values.items():
            if scalar_or_none(value) is not None:
                self.writer.track(scalar_or_none(value), name=key, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.track(aim.Text(value), name=key, step=step, **kwargs)
            else:
                _dropped(self.name, key, value, "numbers and strings")

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, kwargs: Optional[dict] = None) -> None:
        """``values``: name -> image or (image, caption); ``kwargs``: {"aim_image": {...}, "track": {...}}."""
        import aim

        kwargs = kwargs or {}
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(aim.Image(image, caption=caption, **kwargs.get("aim_image", {})), name=key, step=step,
                              **kwargs.get("track", {}))

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class DVCLiveTracker(GeneralTracker):
    """A DVCLive run (``dvclive.Live``; ``kwargs`` such as ``dir`` go to it), or the ``live`` you pass."""

    name = "dvclive"
    requires_logging_directory = False
    package, module = "dvclive", "dvclive"

    def __init__(self, run_name: Optional[str] = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        if self.live is None:
            from dvclive import Live

            self.live = Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.live.log_params(storable_config(values, self.name))

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in values.items():
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                _dropped(self.name, key, value, "numbers")
        self.live.next_step()

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """``values``: file name (e.g. "sample.png") -> a PIL image, NumPy array or path."""
        if step is not None:
            self.live.step = step
        for key, image in values.items():
            self.live.log_image(key, image)

    @on_main_process
    def finish(self) -> None:
        self.live.end()


class TrackioTracker(RunTracker):
    """A Trackio run (local SQLite under ``TRACKIO_DIR``); ``kwargs`` go to ``trackio.init``."""

    name = "trackio"
    package, module = "trackio", "trackio"

    @on_main_process
    def start(self) -> None:
        import trackio

        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(storable_config(values, self.name))
