"""A background save (``save_state(blocking=False)``) as the last line of a script, under every launcher.

The end of the script must wait for the save before the process group goes, so the checkpoint is
complete and loads on 2 processes; a save whose process group the script destroyed itself must fail
loudly (exit status, message) and commit nothing. Rank 1 writes to a slow disk
(scripts/ckpt_background_end.py), so its files come late: a commit that does not wait for it misses
them.
"""

import json
import os
import subprocess
import sys

import pytest

from devices import process_env
from scripts.launch_common import clean_env, free_port, hasten, script


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # process_env: CPU (HASTEN_USE_CPU, which hasten launch, torchrun'd and forked processes all honour)
    # unless each of the 2 processes can have a GPU.
    return clean_env(tmp_path_factory.mktemp("cfg") / "absent.yaml", OMP_NUM_THREADS=1, **process_env(2))


def _run(launcher, project, mode, env, layout="ddp"):
    if launcher == "hasten launch":
        return hasten(["launch", "--num_processes", "2", "--main_process_port", free_port(),
                       script("ckpt_background_end.py"), project, mode, layout], env, timeout=300)[:3]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           script("ckpt_background_end.py"), str(project), mode, layout]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def _committed(project):
    root = project / "checkpoints"
    return sorted(n for n in os.listdir(root) if not n.startswith(".")) if root.exists() else []


def _saved_weights(project):
    return [json.load(open(project / f"saved{r}.json"))["weights"] for r in (0, 1)]


@pytest.mark.parametrize("launcher, layout", [("hasten launch", "ddp"), ("torchrun", "ddp"), ("hasten launch", "fsdp")])
def test_background_save_as_last_line_is_complete_and_loads_on_two_processes(tmp_path, env, launcher, layout):
    project = tmp_path / "project"
    rc, out, err = _run(launcher, project, "late", env, layout)
    assert rc == 0, err[-3000:]
    assert _committed(project) == ["checkpoint_0"]
    manifest = json.load(open(project / "checkpoints" / "checkpoint_0" / "manifest.json"))
    assert {"rank_0.safetensors", "rank_1.safetensors"} <= set(manifest["files"]), sorted(manifest["files"])
    if layout == "fsdp":  # every process's DCP shard file made it in
        assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata"} <= set(manifest["files"])
    rc, out, err = _run(launcher, project, "load", env, layout)
    assert rc == 0, err[-3000:]
    loaded = [json.load(open(project / f"loaded{r}.json")) for r in (0, 1)]
    assert [item["world"] for item in loaded] == [2, 2]
    assert [item["weights"] for item in loaded] == _saved_weights(project)


@pytest.mark.parametrize("launcher", ["hasten launch", "torchrun"])
def test_background_save_whose_process_group_was_destroyed_fails_and_commits_nothing(tmp_path, env, launcher):
    project = tmp_path / "project"
    rc, out, err = _run(launcher, project, "destroy", env)
    assert rc != 0, err[-3000:]
    assert "the process group was destroyed while a save of 2 processes still needed it" in err, err[-3000:]
    assert _committed(project) == []


def test_notebook_launcher_waits_for_the_background_save_and_reports_a_lost_one(tmp_path, env):
    env = dict(env, PYTHONPATH=os.pathsep.join([os.path.dirname(script("x")), env.get("PYTHONPATH", "")]))
    env.pop("OMP_NUM_THREADS")
    runs = {}
    for mode in ("late", "destroy"):
        project = tmp_path / mode
        proc = subprocess.run([sys.executable, script("ckpt_background_notebook.py"), str(project), mode], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = (proc.stdout, _committed(project))
    assert runs["late"] == ("ok\n", ["checkpoint_0"]), runs["late"]
    out, committed = runs["destroy"]
    assert out.startswith("raised") and "ChildFailedError" in out and committed == [], out
    assert "the process group was destroyed while a save of 2 processes still needed it" in out, out
