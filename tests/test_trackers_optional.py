"""The built-in trackers that are not in the test extra, each run when its package is installed.

Every one logs with no network (its offline / local mode) and is read back from what it wrote.
"""

import csv
import glob
import json
import os
import zipfile

import pytest

pytestmark = pytest.mark.usefixtures("fresh_state")


def _run(name, project_dir, init_kwargs=None):
    """init_trackers, three logged steps, end_training; returns the run object."""
    from hasten import Accelerator

    acc = Accelerator(cpu=True, log_with=name, project_dir=str(project_dir))
    acc.init_trackers("proj", config={"lr": 0.1, "nested": {"depth": 2}}, init_kwargs={name: init_kwargs or {}})
    for step in range(3):
        acc.log({"loss": 1.0 / (step + 1)}, step=step)
    run = acc.get_tracker(name, unwrap=True)
    acc.end_training()
    return run


def test_comet_ml_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    monkeypatch.setenv("COMET_API_KEY", "offline")  # never used: nothing is sent
    pytest.importorskip("comet_ml")
    _run("comet_ml", tmp_path, {"online": False})
    (archive,) = glob.glob(str(tmp_path / "comet" / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    assert [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "loss"] == [
        (0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    params = {m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
              for m in messages if m["type"] == "parameter_msg"}
    assert params["lr"] == 0.1


def test_clearml_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml"))
    pytest.importorskip("clearml")
    _run("clearml", tmp_path)
    (metrics_file,) = glob.glob(str(tmp_path / "clearml" / "**" / "metrics.jsonl"), recursive=True)
    with open(metrics_file) as f:
        events = [e for line in f for e in json.loads(line)]
    assert [(e["iter"], e["value"]) for e in events if e.get("metric") == "loss"] == [
        (0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]


def test_dvclive_local_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pytest.importorskip("dvclive")
    _run("dvclive", tmp_path, {"dir": str(tmp_path / "live"), "save_dvc_exp": False})
    with open(tmp_path / "live" / "plots" / "metrics" / "loss.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert "depth" in (tmp_path / "live" / "params.yaml").read_text()


def test_trackio_local_database(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    trackio = pytest.importorskip("trackio")
    if os.path.realpath(str(trackio.TRACKIO_DIR)) != os.path.realpath(str(tmp_path / "trackio")):
        pytest.skip("trackio was imported earlier with another TRACKIO_DIR")
    from trackio.sqlite_storage import SQLiteStorage

    _run("trackio", tmp_path)
    (run_name,) = SQLiteStorage.get_runs("proj")
    logs = SQLiteStorage.get_logs("proj", run_name)
    assert [(row["step"], row["loss"]) for row in logs] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]


def test_swanlab_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    pytest.importorskip("swanlab")
    _run("swanlab", tmp_path, {"logdir": str(tmp_path / "swanlog")})
    (run_file,) = glob.glob(str(tmp_path / "swanlog" / "run-*" / "run-*.swanlab"))
    assert b"loss" in open(run_file, "rb").read()


def test_aim_local_repository(tmp_path):
    aim = pytest.importorskip("aim")
    run = _run("aim", tmp_path)
    assert aim.Repo(str(tmp_path)).list_all_runs() == [run.hash]
