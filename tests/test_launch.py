"""`hasten launch` with real processes: 2 ranks, 2 machines on loopback, failures, restarts.

The scripts talk over gloo (CPU tensors), so they run anywhere; the launch asks for CPU (--cpu) when
the machine has fewer GPUs than processes per machine, as a user on such a machine must.

Each rank writes a file; the tests judge those files (what each rank saw), so a rank that aborts
while tearing down cannot make a passing launch look failed.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from devices import launch_flags
from scripts.launch_common import clean_env, free_port, hasten, ranks, script

TWO = ["--num_processes", "2", *launch_flags(2)]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "absent.yaml")


def test_two_processes_on_cpu_form_one_gloo_group(tmp_path, env):
    rc, out, err, _ = hasten(["launch", *TWO, "--mixed_precision", "bf16",
                              "--gradient_accumulation_steps", "3", script("launch_allreduce.py"), tmp_path, "--lr", "1"],
                             env)
    seen = ranks(tmp_path, 2)
    assert [s["world"] for s in seen] == [2, 2] and [s["sum"] for s in seen] == [3.0, 3.0]
    assert all(s["argv"] == ["--lr", "1"] and s["main"] == "__main__" for s in seen)
    assert all(s["env"]["HASTEN_MIXED_PRECISION"] == "bf16" for s in seen)
    assert all(s["env"]["HASTEN_GRADIENT_ACCUMULATION_STEPS"] == "3" for s in seen)
    assert all(s["env"]["OMP_NUM_THREADS"] == "1" for s in seen)  # inherited from the test's environment
    assert rc == 0, err


def test_one_process_runs_the_script_directly(tmp_path, env):
    rc, _, err, _ = hasten(["launch", "--mixed_precision", "fp16", script("launch_env.py"), tmp_path, "x"], env)
    assert rc == 0, err
    info = json.load(open(tmp_path / "single.json"))
    assert info["argv"][1:] == [str(tmp_path), "x"] and info["main"] == "__main__"
    assert info["env"]["HASTEN_MIXED_PRECISION"] == "fp16" and "RANK" not in info["env"]
    assert info["path0"] == os.path.dirname(script("launch_env.py"))


def test_module_and_no_python(tmp_path, env):
    env = dict(env, PYTHONPATH=os.path.dirname(script("launch_env.py")))
    rc, _, err, _ = hasten(["launch", "-m", "launch_env", tmp_path, "m"], env)
    assert rc == 0, err
    assert json.load(open(tmp_path / "single.json"))["argv"][1:] == [str(tmp_path), "m"]
    rc, _, err, _ = hasten(["launch", "--no_python", "--mixed_precision", "bf16", "sh", "-c",
                            f'echo "$HASTEN_MIXED_PRECISION" > {tmp_path}/sh.txt'], env)
    assert rc == 0, err
    assert (tmp_path / "sh.txt").read_text().strip() == "bf16"


def test_two_machines_on_loopback_form_a_world_of_four(tmp_path, env):
    port = free_port()
    common = ["launch", "--num_machines", "2", "--num_processes", "4", *launch_flags(2), "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), script("launch_allreduce.py"), tmp_path]
    cmd = [sys.executable, "-m", "hasten.commands.cli"]
    nodes = [subprocess.Popen(cmd + common[:1] + ["--machine_rank", str(r)] + common[1:], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=240) for p in nodes]
    seen = ranks(tmp_path, 4)
    assert [s["world"] for s in seen] == [4] * 4, outputs
    assert [s["sum"] for s in seen] == [10.0] * 4
    assert [s["env"]["GROUP_RANK"] for s in seen] == ["0", "0", "1", "1"]
    assert [s["env"]["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1"]
    assert [p.returncode for p in nodes] == [0, 0], outputs


def test_first_failure_is_reported_with_its_traceback(tmp_path, env):
    rc, out, err, took = hasten(["launch", *TWO, script("launch_fail.py"), "raise", tmp_path], env)
    assert rc == 1, err
    report = err[err.index("hasten: rank"):]
    first = report.splitlines()[0]
    assert first.startswith("hasten: rank 1 (local rank 1 on node 0, host ") and "failed with exit code 1:" in first
    assert 'raise ValueError("boom from rank 1")' in report and "ValueError: boom from rank 1" in report
    assert "_bootstrap.py" not in report and "runpy" not in report  # the traceback starts in the script
    assert "hasten: after rank 1 failed: rank 0" in report


def test_a_rank_that_raised_and_was_stopped_while_exiting_is_blamed_for_its_exception(tmp_path, env):
    rc, out, err, took = hasten(["launch", *TWO, script("launch_fail.py"), "raise_hang", tmp_path],
                                env, timeout=240)
    report = err[err.index("hasten: rank"):]
    first = report.splitlines()[0]
    assert first.startswith("hasten: rank 1 (local rank 1 on node 0, host ") and "failed with exit code 1" in first, report
    assert "ValueError: boom from rank 1" in report.split("hasten: after")[0]  # its traceback leads the report
    assert "SIGTERM" not in first.split("failed with exit code 1")[0], report
    assert rc == 1, err  # a failure, not 143 (128 + SIGTERM), which schedulers read as preemption
    assert took < 100, f"rank 1 hangs while exiting; the launch should end once rank 0 failed (took {took:.0f} s)"


def test_sigkill_is_reported_and_other_ranks_stop_promptly(tmp_path, env):
    rc, out, err, took = hasten(["launch", *TWO, script("launch_fail.py"), "kill", tmp_path], env)
    assert rc == 128 + 9, err
    assert "hasten: rank 1 (local rank 1 on node 0" in err
    assert "was killed (SIGKILL) — often the out-of-memory killer" in err
    assert took < 30, f"rank 0 sleeps 60 s; it should have been stopped at once (took {took:.0f} s)"
    pid0 = int((tmp_path / "pid0").read_text())
    assert not alive(pid0), "rank 0 was left running"


def test_killing_the_launcher_leaves_no_orphans(tmp_path, env):
    proc = subprocess.Popen([sys.executable, "-m", "hasten.commands.cli", "launch", *TWO,
                             script("launch_fail.py"), "sleep", tmp_path], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, "the processes never started"
        time.sleep(0.1)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: the children must notice by themselves
    proc.wait()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "children outlived a SIGKILLed launcher"


def test_max_restarts_recovers_on_gloo(tmp_path, env):
    rc, out, err, _ = hasten(["launch", *TWO, "--max_restarts", "1", "--monitor_interval", "0.05",
                              script("launch_restart.py"), tmp_path], env, timeout=300)
    seen = ranks(tmp_path, 2)
    assert [s["attempt"] for s in seen] == [1, 1] and [s["sum"] for s in seen] == [3.0, 3.0], err
    assert rc == 0, err


def test_hasten_test_runs_the_sanity_checks(tmp_path, env):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    rc, out, err, _ = hasten(["test", "--config_file", cfg], env, timeout=300)
    assert rc == 0, out + err
    for line in ("collectives ok", "data sharding ok", "training step ok",
                 "hasten test: success: every check passed on 2 process(es) (MULTI_CPU)."):
        assert line in out, out
