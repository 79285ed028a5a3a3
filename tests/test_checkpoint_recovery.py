"""Crash safety and automatic recovery with real processes and real signals.

- kill -9 of the saving process at 20 random moments: the newest complete checkpoint always
  verifies and loads, training resumes from it and its numbering continues (scripts/ckpt_killer.py),
  with saves in the foreground (page-cache writes) and with ``save_state(blocking=False)`` (O_DIRECT
  writes);
- `hasten launch --max_restarts 1`: a worker SIGKILLed inside a save is restarted, resumes with
  ``resume="auto"`` and ends with the uninterrupted run's weights;
- SIGTERM to one worker with ``save_on_preemption()``: every worker saves at the same step boundary and
  exits cleanly; a new launch resumes and ends with the uninterrupted run's weights.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from scripts.launch_common import clean_env, free_port, hasten, ranks, script

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "cfg.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    return clean_env(cfg, OMP_NUM_THREADS=1)


def _launch(env, out, project, mode, restarts=0, extra=()):
    os.makedirs(out, exist_ok=True)
    args = ["launch", "--num_processes", "2", "--monitor_interval", "0.05", "--main_process_port", free_port(),
            *extra]
    if restarts:
        args += ["--max_restarts", str(restarts)]
    return args + [script("ckpt_recover.py"), out, project, mode]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, env):
    root = tmp_path_factory.mktemp("clean")
    rc, out, err, _ = hasten(_launch(env, root / "out", root / "project", "clean"), env, timeout=300)
    seen = ranks(root / "out", 2)
    assert [s["steps"] for s in seen] == [12, 12], err
    return seen


@pytest.mark.parametrize("mode,writes", [("blocking", "buffered"), ("background", "direct")])
def test_kill_9_while_saving_never_loses_the_newest_complete_checkpoint(tmp_path, mode, writes):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "ckpt_killer.py"), out, tmp_path / "project",
                           "20", "11", mode, writes], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == []
    rounds = report["rounds"]
    assert len(rounds) == 20
    # the kills were real and landed during saves: most rounds left a half-written save behind
    mid_save = sum(1 for prev, cur in zip([{"leftovers": []}] + rounds, rounds)
                   if set(cur["leftovers"]) - set(prev["leftovers"]))
    assert mid_save >= 8, rounds
    # training made progress across the kills and every child resumed where the last one stopped
    assert rounds[-1]["newest"][1] > 20
    assert all(r["complete"] and len(r["complete"]) <= 3 for r in rounds[1:])


def test_restart_after_kill_through_the_launcher_gives_the_uninterrupted_weights(tmp_path, env, uninterrupted):
    rc, out, err, _ = hasten(_launch(env, tmp_path / "out", tmp_path / "project", "kill", restarts=1), env,
                             timeout=300)
    seen = ranks(tmp_path / "out", 2)
    assert [s["attempt"] for s in seen] == [1, 1], err
    assert [s["resumed_at"] for s in seen] == [4, 4]  # the save at step 6 died half-way: step 4's is newest
    for rank in range(2):
        assert seen[rank]["weights"] == uninterrupted[rank]["weights"]
    names = sorted(os.listdir(tmp_path / "project" / "checkpoints"))
    assert names == ["checkpoint_4", "checkpoint_5"]  # numbering continued; no half-written folder left


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path, env, uninterrupted):
    out, project = tmp_path / "out", tmp_path / "project"
    args = _launch(env, out, project, "preempt")
    proc = subprocess.Popen([sys.executable, "-m", "hasten.commands.cli", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "pid1").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert (out / "pid1").exists(), proc.communicate(timeout=30)[0][-3000:]
        time.sleep(0.2)
        os.kill(int((out / "pid1").read_text()), signal.SIGTERM)  # one rank only: they must agree
        log = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log[-3000:]
    assert not (out / "rank0.json").exists()  # the script stopped at the boundary, it did not finish
    newest = project / "checkpoints" / "checkpoint_2"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["mid_accumulation"]  # saved between micro-steps
    rc, text, err, _ = hasten(_launch(env, tmp_path / "again", project, "clean"), env, timeout=300)
    seen = ranks(tmp_path / "again", 2)
    assert [s["resumed_at"] for s in seen] == [5, 5], err
    for rank in range(2):
        assert seen[rank]["weights"] == uninterrupted[rank]["weights"]


DEEPSPEED = ["--use_deepspeed", "--zero_stage", "2", "--gradient_clipping", "1.0"]


def test_deepspeed_kill_after_engine_files_resumes_from_the_previous_checkpoint(tmp_path, env):
    """ZeRO-2 engine checkpoints inside the commit: rank 1 dies once its engine files are written."""
    pytest.importorskip("deepspeed")
    clean = tmp_path / "clean"
    hasten(_launch(env, clean / "out", clean / "project", "clean", extra=DEEPSPEED), env, timeout=300)
    reference = ranks(clean / "out", 2)
    rc, out, err, _ = hasten(_launch(env, tmp_path / "out", tmp_path / "project", "kill", restarts=1,
                                     extra=DEEPSPEED), env, timeout=300)
    seen = ranks(tmp_path / "out", 2)
    assert [s["attempt"] for s in seen] == [1, 1], err
    assert [s["resumed_at"] for s in seen] == [4, 4]  # step 6's save died before its manifest
    for rank in range(2):
        assert seen[rank]["weights"] == reference[rank]["weights"]
    assert sorted(os.listdir(tmp_path / "project" / "checkpoints")) == ["checkpoint_4", "checkpoint_5"]
