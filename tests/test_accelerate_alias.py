"""``hasten.install_as_accelerate()``: a library built on Accelerate runs on hasten unedited.

Each alias check runs in a subprocess of its own (the alias changes ``sys.modules`` and ``sys.meta_path``).
The Trainer tests run transformers' ``Trainer`` (tests/alias_trainer_script.py: a tiny GPT-2 from a config,
``save_steps`` and ``resume_from_checkpoint``) on hasten with 1 process (``python -m hasten.as_accelerate``)
and 2 (``HASTEN_AS_ACCELERATE=1 hasten launch``), and the same script with Accelerate (``python``,
``torchrun``); all four jobs start together, once for the module.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from devices import launch_flags, ranks_get_own_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
SCRIPT = os.path.join(HERE, "alias_trainer_script.py")
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "HASTEN_AS_ACCELERATE"}
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _python(code, *args, env=None, cwd=None):
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=120, env=env or _env(), cwd=cwd)
    return out


def _json(out):
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_by_default():
    got = _json(_python("""
        import importlib.util, json, os, sys
        import hasten, hasten.utils
        from hasten.as_accelerate import is_installed
        spec = importlib.util.find_spec("accelerate")
        ours = os.path.dirname(os.path.abspath(hasten.__file__))
        print(json.dumps({"installed": is_installed(), "origin": spec and spec.origin, "ours": ours,
                          "imported": [m for m in sys.modules if m.split(".")[0] == "accelerate"]}))
    """))
    assert got["installed"] is False and got["imported"] == []
    # The real package, if there is one: nothing found inside hasten's own folder (a path such as a
    # venv under /tmp/hasten-ci... may well contain the word).
    assert got["origin"] is None or not os.path.abspath(got["origin"]).startswith(got["ours"] + os.sep)


def test_alias_resolves_to_hasten_modules():
    got = _json(_python("""
        import importlib, importlib.metadata, importlib.util, json, sys
        import hasten
        hasten.install_as_accelerate()
        hasten.install_as_accelerate()  # idempotent
        from hasten.as_accelerate import AccelerateAlias
        finders = sum(isinstance(f, AccelerateAlias) for f in sys.meta_path)
        torch_before = "torch" in sys.modules
        import accelerate, accelerate.utils, accelerate.utils.memory, accelerate.utils.dataclasses
        import hasten.utils.memory
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType, GradientAccumulationPlugin
        from accelerate.data_loader import skip_first_batches
        import hasten.state
        try:
            import accelerate.no_such_module
            missing = "imported"
        except ModuleNotFoundError as exc:
            missing = str(exc)
        spec = importlib.util.find_spec("accelerate")
        print(json.dumps({
            "finders": finders, "torch_before": torch_before,
            "same": [accelerate is hasten, accelerate.utils.memory is hasten.utils.memory,
                     AcceleratorState is hasten.state.AcceleratorState, PartialState is hasten.state.PartialState,
                     DistributedType is hasten.utils.dataclasses.DistributedType,
                     sys.modules["accelerate.utils.dataclasses"] is sys.modules["hasten.utils.dataclasses"]],
            "own_names": [accelerate.utils.memory.__name__, accelerate.utils.memory.__spec__.name,
                          importlib.util.find_spec("hasten.utils.memory").name],
            "missing": missing, "spec": spec is not None,
            "metadata": importlib.metadata.version("accelerate"),
            "metadata_dist": importlib.metadata.distribution("accelerate").metadata["Name"],
            "in_distributions": sum(d.metadata["Name"] == "accelerate" for d in importlib.metadata.distributions()),
            "version": accelerate.__version__, "hasten": hasten.__version__,
            "env": __import__("os").environ.get("HASTEN_AS_ACCELERATE"),
        }))
    """))
    assert got["finders"] == 1 and got["torch_before"] is False
    assert all(got["same"]), got["same"]
    assert got["own_names"] == ["hasten.utils.memory"] * 3  # hasten's modules keep their names and specs
    assert got["missing"] == "No module named 'accelerate.no_such_module'"
    assert got["spec"] and got["metadata"] == got["version"] == got["hasten"]
    assert got["metadata_dist"] == "accelerate" and got["in_distributions"] >= 1
    assert got["env"] == "1"  # processes that `hasten launch` starts from here get the alias too


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_transformers_sees_accelerate_available():
    got = _json(_python("""
        import json
        import hasten
        hasten.install_as_accelerate()
        from transformers.utils import import_utils
        print(json.dumps([import_utils.is_accelerate_available(), import_utils.is_accelerate_available("1.15.0"),
                          import_utils.is_accelerate_available("1.16.0"),
                          import_utils._is_package_available("accelerate", return_version=True)[1]]))
    """))
    import hasten

    assert got == [True, True, False, hasten.__version__]


def test_refused_when_the_real_accelerate_is_imported():
    # A stand-in module under the name (the refusal reads sys.modules), so this runs without Accelerate too.
    out = _python("""
        import sys, types
        sys.modules["accelerate"] = types.ModuleType("accelerate")
        import hasten
        hasten.install_as_accelerate()
    """)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: install_as_accelerate(): the real accelerate is already imported (accelerate"), last
    assert "HASTEN_AS_ACCELERATE=1" in last


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed")
def test_refused_after_importing_real_accelerate_submodule():
    out = _python("""
        import accelerate.utils.versions  # the real package (no torch needed for this module's parent?)
        import hasten
        hasten.install_as_accelerate()
    """)
    assert out.returncode == 1 and "the real accelerate is already imported" in out.stderr, out.stderr


def test_enabled_without_code_change(tmp_path):
    script = tmp_path / "uses_accelerate.py"
    script.write_text("import json, sys, accelerate\nprint(json.dumps([accelerate.__name__, sys.argv[1:], __name__]))\n")
    bootstrap = os.path.join(SRC, "hasten", "commands", "_bootstrap.py")
    by_env = subprocess.run([sys.executable, bootstrap, str(script), "a", "--b"], capture_output=True, text=True,
                            timeout=60, env=_env(HASTEN_AS_ACCELERATE="1"))
    by_runner = subprocess.run([sys.executable, "-m", "hasten.as_accelerate", str(script), "a", "--b"],
                               capture_output=True, text=True, timeout=60, env=_env())
    assert _json(by_env) == _json(by_runner) == ["hasten", ["a", "--b"], "__main__"]
    if HAVE_ACCELERATE:  # and without the variable, the launcher's bootstrap leaves accelerate alone
        plain = subprocess.run([sys.executable, bootstrap, str(script)], capture_output=True, text=True, timeout=120,
                               env=_env())
        assert _json(plain)[0] == "accelerate"


# -- transformers' Trainer --------------------------------------------------------------------------
needs_trainer = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """All jobs at once (each is mostly imports): name -> report (or the failed job's output)."""
    root = tmp_path_factory.mktemp("trainer")
    cpu2 = [] if ranks_get_own_gpu(2) else ["--cpu"]
    jobs = {
        "hasten1": [sys.executable, "-m", "hasten.as_accelerate", SCRIPT],
        "hasten2": [sys.executable, "-m", "hasten.commands.cli", "launch", *launch_flags(2), "--num_processes", "2",
                    SCRIPT, *cpu2],
    }
    if HAVE_ACCELERATE:
        jobs["accelerate1"] = [sys.executable, SCRIPT]
        jobs["accelerate2"] = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               SCRIPT, *cpu2]
    started = {}
    for name, command in jobs.items():
        out, report = root / name, root / f"{name}.json"
        env = _env(HASTEN_AS_ACCELERATE="1") if name == "hasten2" else _env()
        if cpu2 and name == "accelerate2":
            env["ACCELERATE_USE_CPU"] = "1"
        with open(root / f"{name}.log", "w") as log:  # a file, not a pipe: nobody reads while waiting on another
            started[name] = (subprocess.Popen([*command, str(out), "--report", str(report)], stdout=log,
                                              stderr=subprocess.STDOUT, env=env, cwd=str(root)), report)
    results = {}
    try:
        for name, (proc, report) in started.items():
            code = proc.wait(timeout=300)
            results[name] = json.loads(report.read_text()) if code == 0 else (root / f"{name}.log").read_text()[-4000:]
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
    return results


def _report(runs, name):
    value = runs[name]
    assert isinstance(value, dict), f"{name} failed:\n{value}"
    return value


def _assert_same(a, b, atol=1e-6):
    assert [h["step"] for h in a["history"]] == [h["step"] for h in b["history"]] == list(range(1, 7))
    for x, y in zip(a["history"], b["history"]):
        assert set(x) == set(y)
        for key in x:
            assert x[key] == pytest.approx(y[key], abs=atol), (key, x, y)
    assert a["global_step"] == b["global_step"] == 6
    assert set(a["weights"]) == set(b["weights"])
    worst = max(max(abs(p - q) for p, q in zip(a["weights"][k], b["weights"][k])) for k in a["weights"])
    assert worst <= atol, worst
    assert a["predict_shape"] == b["predict_shape"] == [10, 12, 64]
    assert a["predict_loss"] == pytest.approx(b["predict_loss"], abs=atol)
    assert a["predict_sum"] == pytest.approx(b["predict_sum"], rel=1e-6, abs=atol)


@needs_trainer
@pytest.mark.parametrize("processes", [1, 2])
def test_trainer_on_hasten_resumes_exactly(trainer_runs, processes):
    report = _report(trainer_runs, f"hasten{processes}")
    assert report["accelerate"].startswith(os.path.join(SRC, "hasten")), report["accelerate"]  # hasten answered
    assert report["world_size"] == processes and report["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
    _assert_same(report["uninterrupted"], report["resumed"])
    losses = [h["loss"] for h in report["uninterrupted"]["history"]]
    assert len(set(losses)) == len(losses)  # it trained: the loss moves every step


@needs_trainer
@pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed")
@pytest.mark.parametrize("processes", [1, 2])
def test_trainer_on_hasten_equals_accelerate(trainer_runs, processes):
    ours, theirs = _report(trainer_runs, f"hasten{processes}"), _report(trainer_runs, f"accelerate{processes}")
    assert "site-packages" in theirs["accelerate"] or "hasten" not in theirs["accelerate"]
    assert theirs["world_size"] == processes and theirs["checkpoints"] == ours["checkpoints"]
    assert ours["distributed_type"].split(".")[-1] == theirs["distributed_type"].split(".")[-1]
    for run in ("uninterrupted", "resumed"):
        _assert_same(ours[run], theirs[run])


def test_one_process_gather_for_metrics_weighs_the_short_last_batch():
    # What the Trainer's evaluation loss relies on: it gathers loss.repeat(batch_size) for every batch, and
    # the last, short batch (10 samples, batches of 4: 2 left) must count 2 times, not 4 (as in Accelerate).
    # Tensors with one row per sample, and any other shape, are kept as they are.
    got = _json(_python("""
        import json, torch, hasten
        acc = hasten.Accelerator()
        loader = acc.prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=4))
        rows = []
        for batch in loader:
            loss = batch.float().mean().to(acc.device)
            rows.append([acc.gather_for_metrics(loss.repeat(4)).shape[0], acc.gather_for_metrics(batch).tolist(),
                         acc.gather_for_metrics(torch.zeros(3, device=acc.device)).shape[0],
                         acc.gather_for_metrics({"l": loss.repeat(4)})["l"].shape[0]])
        outside = acc.gather_for_metrics(torch.zeros(4, device=acc.device)).shape[0]
        print(json.dumps([rows, outside]))
    """))
    assert got == [[[4, [0, 1, 2, 3], 3, 4], [4, [4, 5, 6, 7], 3, 4], [2, [8, 9], 3, 2]], 4]
