"""Trackers backed by a service, each of which can also log without a network.

- wandb: ``WANDB_MODE=offline`` (or ``init_kwargs={"wandb": {"mode": "offline"}}``).
- mlflow: a local store, e.g. ``MLFLOW_TRACKING_URI=sqlite:///mlflow.db`` or
  ``init_kwargs={"mlflow": {"tracking_uri": ...}}``.
- comet_ml: ``init_kwargs={"comet_ml": {"online": False}}`` with ``COMET_OFFLINE_DIRECTORY``.
- clearml: ``CLEARML_OFFLINE_MODE=1`` (or ``Task.set_offline(True)`` before ``init_trackers``).
- swanlab: ``SWANLAB_MODE=offline`` (or ``init_kwargs={"swanlab": {"mode": "offline"}}``).

Each imports its package in ``start`` only.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from .base import GeneralTracker, RunTracker, on_main_process, scalar_or_none, storable_config, warn_once


class WandBTracker(RunTracker):
    """A Weights & Biases run in project ``run_name``; ``kwargs`` go to ``wandb.init``."""

    name = "wandb"
    package, module = "wandb", "wandb"

    @on_main_process
    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(storable_config(values, self.name), allow_val_change=True)

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """``values``: name -> list of images (NumPy arrays, PIL images or tensors)."""
        import wandb

        self.run.log({key: [wandb.Image(image) for image in images] for key, images in values.items()},
                     step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: Optional[list[str]] = None, data: Optional[list[list[Any]]] = None,
                  dataframe: Any = None, step: Optional[int] = None, **kwargs: Any) -> None:
        """A ``wandb.Table`` from ``columns`` + ``data`` (rows) or from a pandas ``dataframe``."""
        import wandb

        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step, **kwargs)


class MLflowTracker(GeneralTracker):
    """An MLflow run in experiment ``experiment_name`` (created when missing).

    ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` (JSON) and
    ``MLFLOW_NESTED_RUN`` override the arguments, as in Accelerate. ``logging_dir`` is the
    experiment's artifact location; ``tracking_uri`` (a hasten addition) selects the store.
    """

    name = "mlflow"
    requires_logging_directory = False
    package, module = "mlflow", "mlflow"

    def __init__(self, experiment_name: Optional[str] = None, logging_dir: Any = None, run_id: Optional[str] = None,
                 tags: Any = None, nested_run: Any = False, run_name: Optional[str] = None,
                 description: Optional[str] = None, tracking_uri: Optional[str] = None) -> None:
        super().__init__()
        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = os.fspath(logging_dir) if logging_dir is not None else None
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = nested.strip().lower() in ("1", "true", "yes", "on") if isinstance(nested, str) else bool(nested)
        self.run_name = run_name
        self.description = description
        self.tracking_uri = tracking_uri
        self.active_run: Any = None

    @on_main_process
    def start(self) -> None:
        import mlflow

        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        experiment = mlflow.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = mlflow.create_experiment(self.experiment_name, artifact_location=self.logging_dir,
                                                     tags=self.tags)
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, nested=self.nested_run,
                                           tags=self.tags, description=self.description, run_name=self.run_name)

    @property
    def tracker(self) -> Any:
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Parameters (nested keys joined with "/"); values longer than MLflow allows are dropped with a warning."""
        import mlflow
        from mlflow.utils import validation

        params = {}
        for key, value in storable_config(values, self.name, flat=True).items():
            if len(str(value)) > validation.MAX_PARAM_VAL_LENGTH:
                warn_once(f"mlflow: parameter {key!r} was not stored: its text is longer than "
                          f"{validation.MAX_PARAM_VAL_LENGTH} characters, MLflow's limit")
            else:
                params[key] = value
        items = list(params.items())
        batch = validation.MAX_PARAMS_TAGS_PER_BATCH
        for i in range(0, len(items), batch):
            mlflow.log_params(dict(items[i:i + batch]))

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        import mlflow

        metrics = {}
        for key, value in values.items():
            number = scalar_or_none(value)
            if number is None:
                warn_once(f"mlflow: value of {key!r} ({type(value).__name__}) was not logged; MLflow metrics are numbers")
            else:
                metrics[key] = float(number)
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """A matplotlib or plotly figure, saved as the run's artifact ``artifact_file``."""
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: Optional[str] = None) -> None:
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class CometMLTracker(GeneralTracker):
    """A Comet experiment in project ``run_name``; ``kwargs`` go to ``comet_ml.start``."""

    name = "comet_ml"
    requires_logging_directory = False
    package, module = "comet-ml", "comet_ml"

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        import comet_ml

        self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer.log_parameters(storable_config(values, self.name))

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            if scalar_or_none(value) is not None:
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)
            else:
                warn_once(f"comet_ml: value of {key!r} ({type(value).__name__}) was not logged")

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """``values``: name -> an image (NumPy array, PIL image or file path)."""
        for key, image in values.items():
            self.writer.log_image(image, name=key, step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: Optional[list[str]] = None, data: Optional[list[list[Any]]] = None,
                  dataframe: Any = None, step: Optional[int] = None, **kwargs: Any) -> None:
        """A table asset named ``table_name`` (e.g. "results.csv") from rows or a pandas dataframe."""
        self.writer.log_table(table_name, tabular_data=dataframe if dataframe is not None else data,
                              headers=columns or False, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.end()


def _title_and_series(name: str) -> tuple[str, str]:
    """ClearML plots by (title, series): "eval_loss" is title "loss", series "eval" (train by default)."""
    for prefix in ("eval", "test", "train"):
        if name.startswith(prefix + "_"):
            return name[len(prefix) + 1:], prefix
    return name, "train"


class ClearMLTracker(GeneralTracker):
    """A ClearML task (or the one already running); ``CLEARML_PROJECT``/``CLEARML_TASK`` override the names."""

    name = "clearml"
    requires_logging_directory = False
    package, module = "clearml", "clearml"

    def __init__(self, run_name: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__()
        self.user_provided_run_name = run_name
        self.init_kwargs = kwargs
        self._initialized_externally = False
        self.task: Any = None

    @on_main_process
    def start(self) -> None:
        from clearml import Task

        current = Task.current_task()
        if current:
            self.task, self._initialized_externally = current, True
            return
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        kwargs.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = Task.init(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict) -> Any:
        return self.task.connect_configuration(storable_config(values, self.name))

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers only: without ``step`` as single values, with it as scalars (see ``_title_and_series``)."""
        report = self.task.get_logger()
        for key, value in values.items():
            number = scalar_or_none(value)
            if number is None:
                warn_once(f"clearml: value of {key!r} ({type(value).__name__}) was not logged; ClearML scalars are numbers")
            elif step is None:
                report.report_single_value(name=key, value=number, **kwargs)
            else:
                title, series = _title_and_series(key)
                report.report_scalar(title=title, series=series, value=number, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        report = self.task.get_logger()
        for key, image in values.items():
            title, series = _title_and_series(key)
            report.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: Optional[list[str]] = None, data: Optional[list[list[Any]]] = None,
                  dataframe: Any = None, step: Optional[int] = None, **kwargs: Any) -> None:
        if dataframe is None and data is None:
            raise ValueError(f"clearml log_table({table_name!r}) needs data=[rows] or dataframe=...")
        table = dataframe if dataframe is not None else ([columns] + data if columns else data)
        title, series = _title_and_series(table_name)
        self.task.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.task and not self._initialized_externally:
            self.task.close()


class SwanLabTracker(RunTracker):
    """A SwanLab run in project ``run_name``; ``kwargs`` (e.g. ``mode="offline"``) go to ``swanlab.init``."""

    name = "swanlab"
    package, module = "swanlab", "swanlab"

    @on_main_process
    def start(self) -> None:
        import swanlab

        self.run = swanlab.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        import swanlab

        swanlab.config.update(storable_config(values, self.name))

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        import swanlab

        self.run.log({key: [swanlab.Image(image) for image in images] for key, images in values.items()},
                     step=step, **kwargs)
