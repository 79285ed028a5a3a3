"""Experiment trackers: real tensorboard, mlflow and wandb runs, read back with their own readers.

The other built-in trackers are tested in test_trackers_optional.py when their package is installed.
"""

import os
import subprocess
import sys

import pytest

import tracker_readers as read

pytestmark = pytest.mark.usefixtures("fresh_state")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker in offline / local mode, writing under tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    return tmp_path


def _accelerator(**kwargs):
    from hasten import Accelerator

    return Accelerator(cpu=True, **kwargs)


def _config():
    import torch

    return {"lr": 0.01, "epochs": 3, "name": "exp", "flag": True, "none": None, "tensor": torch.tensor(2.5),
            "vector": torch.arange(3), "nested": {"depth": 2, "sizes": [4, 8]}, "obj": object()}


def test_tensorboard_round_trip(offline):
    import numpy as np
    import torch

    acc = _accelerator(log_with="tensorboard", project_dir=str(offline / "runs"))
    with pytest.warns(UserWarning, match="tensor"):
        acc.init_trackers("proj", config=_config(), init_kwargs={"tensorboard": {"flush_secs": 5}})
    for step in range(3):
        acc.log({"loss": torch.tensor(1.0 / (step + 1)), "acc": step / 10, "note": f"s{step}",
                 "pair": {"a": step, "b": 2 * step}}, step=step)
    acc.get_tracker("tensorboard").log_images({"samples": np.zeros((2, 3, 4, 4), dtype=np.float32)}, step=1)
    assert acc.get_tracker("tensorboard", unwrap=True).__class__.__name__ == "SummaryWriter"
    acc.end_training()
    run = str(offline / "runs" / "proj")
    scalars = read.tensorboard_scalars(run)
    assert scalars["loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [v for _, v in scalars["acc"]] == pytest.approx([0.0, 0.1, 0.2])
    assert read.tensorboard_texts(run)["note/text_summary"] == [(0, "s0"), (1, "s1"), (2, "s2")]
    assert read.tensorboard_images(run) == {"samples": [1]}
    assert read.tensorboard_scalars(os.path.join(run, "pair_b"))["pair"] == [(0, 0.0), (1, 2.0), (2, 4.0)]
    hparams = read.tensorboard_hparams(run)
    assert hparams["lr"] == pytest.approx(0.01) and hparams["tensor"] == 2.5 and hparams["nested/depth"] == 2
    assert hparams["vector"] == "[0, 1, 2]" and hparams["none"] == "None" and hparams["obj"].startswith("<object")
    assert os.path.exists(os.path.join(run, "hparams.yml"))
    assert acc.trackers == []  # end_training finished and forgot them


def test_mlflow_round_trip(offline):
    acc = _accelerator(log_with="mlflow")
    acc.init_trackers("exp1", config=_config())
    acc.log({"loss": 0.5, "text": "not a metric"}, step=1)
    acc.log({"loss": 0.25}, step=2)
    assert acc.get_tracker("mlflow", unwrap=True).info.run_id
    acc.end_training()
    (run,) = read.mlflow_runs(f"sqlite:///{offline}/mlflow.db", "exp1")
    assert run["status"] == "FINISHED"
    assert run["metrics"] == {"loss": [(1, 0.5), (2, 0.25)]}
    assert run["params"]["lr"] == "0.01" and run["params"]["nested/depth"] == "2" and run["params"]["tensor"] == "2.5"


def test_wandb_round_trip(offline):
    import numpy as np

    acc = _accelerator(log_with=["wandb"])
    acc.init_trackers("proj", config=_config(), init_kwargs={"wandb": {"tags": ["t"]}})
    for step in range(3):
        acc.log({"loss": 1.0 / (step + 1), "phase": "train"}, step=step)
    tracker = acc.get_tracker("wandb")
    tracker.log_table("preds", columns=["x", "y"], data=[[1, 2], [3, 4]], step=3)
    tracker.log_images({"img": [np.zeros((4, 4, 3), dtype=np.uint8)]}, step=3)
    acc.end_training()
    (path,) = read.wandb_offline_runs(str(offline))
    history = read.wandb_history(path)
    assert history["loss"] == [(0, 1), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert history["phase"] == [(0, "train"), (1, "train"), (2, "train")]
    assert history["preds/_type"] == [(3, "table-file")] and history["img/_type"] == [(3, "images/separated")]
    config = read.wandb_config(path)
    assert config["lr"] == 0.01 and config["nested"] == {"depth": 2, "sizes": [4, 8]} and config["tensor"] == 2.5
    assert read.wandb_exited(path)


class Recorder:
    """A custom tracker written as Accelerate's docs show (GeneralTracker subclass)."""

    def __init__(self, main_process_only=True):
        from hasten.tracking import GeneralTracker

        class RecorderTracker(GeneralTracker):
            name = "recorder"
            requires_logging_directory = False

            def __init__(inner):
                super().__init__()
                inner.events = []
                inner.main_process_only = main_process_only

            @property
            def tracker(inner):
                return inner.events

            def start(inner):
                inner.events.append(("start",))

            def store_init_configuration(inner, values):
                inner.events.append(("config", values))

            def log(inner, values, step=None, **kwargs):
                inner.events.append(("log", values, step, kwargs))

            def finish(inner):
                inner.events.append(("finish",))

        self.tracker = RecorderTracker()


def test_custom_tracker_and_log_kwargs(offline):
    import torch

    custom = Recorder().tracker
    acc = _accelerator(log_with=[custom, "tensorboard"], project_dir=str(offline))
    acc.init_trackers("p", config={"a": 1}, init_kwargs={"recorder": {}})
    acc.log({"x": torch.tensor([2.0])}, step=4, log_kwargs={"recorder": {"k": 1}})
    assert acc.get_tracker("recorder") is custom and acc.get_tracker("recorder", unwrap=True) is custom.events
    with pytest.raises(ValueError, match="'nope'.*recorder"):
        acc.get_tracker("nope")
    with pytest.raises(RuntimeError, match="already called"):
        acc.init_trackers("p")
    acc.end_training()
    assert custom.events == [("start",), ("config", {"a": 1}), ("log", {"x": 2.0}, 4, {"k": 1}), ("finish",)]


def test_tracking_off_is_a_no_op():
    acc = _accelerator()
    acc.init_trackers("p", config={"a": 1})
    acc.log({"loss": 1.0})
    blank = acc.get_tracker("wandb")  # a tracker that does nothing, as in Accelerate
    blank.log({"loss": 1.0})
    assert acc.trackers == []
    acc.end_training()


@pytest.mark.parametrize("log_with, error, words", [
    ("wandbb", ValueError, ["'wandbb'", "did you mean 'wandb'"]),
    (["wandb", "nope"], ValueError, ["'nope'", "comet_ml"]),
    ("tensorboard", ValueError, ["Logging with `tensorboard` requires a `logging_dir`", "project_dir"]),
    (object(), TypeError, ["GeneralTracker", "tensorboard"]),
])
def test_bad_log_with(log_with, error, words):
    with pytest.raises(error) as err:
        _accelerator(log_with=log_with)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_tracker_class_missing_attributes():
    from hasten.tracking import GeneralTracker

    class NoName(GeneralTracker):
        requires_logging_directory = False

    class NoTracker(GeneralTracker):
        name = "x"

        def __init__(self):  # skips GeneralTracker's own check
            pass

    with pytest.raises(NotImplementedError, match="NoName does not define name, tracker"):
        NoName()
    with pytest.raises(NotImplementedError, match="NoTracker given in log_with does not define requires_logging_directory, tracker"):
        _accelerator(log_with=NoTracker())
    with pytest.raises(TypeError, match="pass an instance"):
        _accelerator(log_with=NoTracker)


def test_missing_package_is_one_clear_error(monkeypatch):
    import hasten.tracking.registry as registry

    monkeypatch.setattr(registry, "_installed", lambda module: module not in ("wandb", "comet_ml"))
    with pytest.raises(ImportError, match=r"needs the 'wandb' package.*pip install 'hasten\[wandb\]'"):
        _accelerator(log_with=["tensorboard", "wandb"], project_dir="runs")
    with pytest.raises(ImportError, match=r"'comet-ml' package.*hasten\[comet-ml\]"):
        _accelerator(log_with="comet_ml")


def test_all_uses_the_installed_trackers_and_says_which(monkeypatch, capsys):
    import hasten.tracking.registry as registry

    monkeypatch.setattr(registry, "_installed", lambda module: module in ("tensorboard", "mlflow"))
    acc = _accelerator(log_with="all")
    assert [str(t) for t in acc.log_with] == ["mlflow"]
    assert "uses the installed trackers: mlflow (tensorboard skipped: they need a logging directory" in capsys.readouterr().out
    acc = _accelerator(log_with=["all", Recorder().tracker], project_dir="runs")
    assert [str(t) if isinstance(t, str) else t.name for t in acc.log_with] == ["recorder", "mlflow", "tensorboard"]
    monkeypatch.setattr(registry, "_installed", lambda module: False)
    assert _accelerator(log_with="all").log_with == []
    assert "found no installed tracker" in capsys.readouterr().out


def test_import_selects_without_importing_tracker_packages(tmp_path):
    code = (
        "import sys, hasten, hasten.tracking\n"
        "from hasten import Accelerator\n"
        "acc = Accelerator(cpu=True, log_with=['tensorboard', 'wandb', 'mlflow'], project_dir=sys.argv[1])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'tensorboard', 'tensorboardX', 'wandb', 'mlflow',"
        " 'comet_ml', 'aim', 'clearml', 'dvclive', 'swanlab', 'trackio'})\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
