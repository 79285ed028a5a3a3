"""notebook_launcher / debug_launcher: real forked processes; refusal when CUDA is initialised;
no patching of torch."""

import json
import os
import subprocess
import sys

import pytest
import torch

from devices import process_env
from hasten import launchers
from scripts.launch_common import clean_env, script


def test_notebook_and_debug_launchers_run_two_ranks(tmp_path):
    env = clean_env(tmp_path / "absent.yaml", **process_env(2))  # CPU unless each rank can have a GPU
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, script("launch_notebook.py"), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent = int(proc.stdout.split("parent pid")[1].split()[0])
    for tag, precision, cpu in (("nb", "bf16", env.get("HASTEN_USE_CPU")), ("dbg", None, "true")):
        seen = [json.load(open(tmp_path / f"{tag}{r}.json")) for r in (0, 1)]
        assert [s["world"] for s in seen] == [2, 2] and [s["sum"] for s in seen] == [3.0, 3.0], tag
        assert all(s["parent"] == parent and s["fork"] == "1" for s in seen), tag  # forked from the interpreter
        assert all(s["precision"] == precision and s["cpu"] == cpu for s in seen), tag
        assert seen[0]["pid"] != seen[1]["pid"]
    error = json.load(open(tmp_path / "error.json"))
    assert error["rank"] == 1
    assert error["message"].startswith("hasten: rank 1 (local rank 1 on node 0")
    assert "KeyError: 'broken on rank 1'" in error["message"]


def test_importing_the_launchers_patches_nothing_in_torch():
    code = ("import torch; before = torch.cuda._lazy_init; import hasten.launchers; "
            "assert torch.cuda._lazy_init is before, torch.cuda._lazy_init; "
            "assert not hasattr(torch.cuda, '_hasten_tracks_init')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cuda_initialised_in_parent_is_refused_before_forking(monkeypatch):
    forks = []
    monkeypatch.setattr(launchers, "_forked", lambda *a: forks.append(a))  # never reached: refused first
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # what the launcher asks at launch time
    with pytest.raises(RuntimeError) as exc:
        launchers.notebook_launcher(print, num_processes=2, use_port="0")
    message = str(exc.value)
    assert message.startswith("CUDA is already initialised in this process") and forks == []
    assert "torch.cuda.is_initialized() after each" in message and "Restart the kernel" in message


@pytest.mark.parametrize("kwargs,fragment", [
    ({"mixed_precision": "fp64"}, "mixed_precision='fp64'"),
    ({"num_processes": 0}, "num_processes=0"),
    ({"num_processes": 2, "use_port": "http"}, "use_port='http'"),
    ({"num_processes": 2, "use_port": "0", "num_nodes": 2}, "one machine only"),
])
def test_notebook_launcher_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError) as exc:
        launchers.notebook_launcher(print, **kwargs)
    assert fragment in str(exc.value)


def test_one_process_runs_in_this_interpreter(monkeypatch):
    monkeypatch.delenv("HASTEN_MIXED_PRECISION", raising=False)
    seen = []
    launchers.notebook_launcher(lambda x: seen.append((x, os.getpid(), os.environ["HASTEN_MIXED_PRECISION"])), ("a",),
                                num_processes=1, mixed_precision="fp16")
    assert seen == [("a", os.getpid(), "fp16")] and "HASTEN_MIXED_PRECISION" not in os.environ
