"""What the terminal shows when a job under `hasten launch` fails, is interrupted, or warns.

Real launches of 2 gloo processes: a failure shows hasten's report with the first failing rank's
traceback once (not the other ranks' "Connection closed by peer" tracebacks), the full per-rank
tracebacks stay in --log_dir; Ctrl-C is one line and exit status 130; hasten's own warnings are
one line ``hasten: warning: ...`` while users' filters still apply to them.
"""

import glob
import os
import signal
import subprocess
import sys
import time

import hasten
from devices import launch_flags
from scripts.launch_common import clean_env

TWO = ["--num_processes", "2", *launch_flags(2)]

FAILING = '''
import sys, time, warnings
import torch
import torch.distributed as dist
from hasten import Accelerator
from hasten.warning_kinds import HastenWarning

acc = Accelerator()
print(f"hello from rank {acc.process_index}", flush=True)
if acc.process_index == 0:
    warnings.warn("the quiet test's own warning", HastenWarning)
    warnings.filterwarnings("ignore", message="silenced by the user")
    warnings.warn("silenced by the user", HastenWarning)
    warnings.warn("a user's own warning", UserWarning)
if acc.process_index == 1:
    time.sleep(1)  # rank 0 is waiting in the collective when rank 1 fails
    raise ValueError("boom")
t = torch.ones(1)
dist.all_reduce(t)
dist.all_reduce(t)
'''

SLEEPING = '''
import pathlib, sys, time
from hasten import Accelerator

acc = Accelerator()
pathlib.Path(sys.argv[1], f"up{acc.process_index}").write_text("1")
time.sleep(120)
'''


def _launch(args, tmp_path, **kwargs):
    env = clean_env(tmp_path / "absent.yaml")
    return subprocess.Popen([sys.executable, "-m", "hasten.commands.cli", "launch", *TWO, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_failure_shows_the_first_traceback_once_and_keeps_the_logs(tmp_path):
    path = tmp_path / "fail.py"
    path.write_text(FAILING)
    logs = tmp_path / "logs"
    proc = _launch(["--log_dir", logs, path], tmp_path)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err
    assert "hello from rank 0" in out and "hello from rank 1" in out  # the script's prints still stream
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count("ValueError: boom") == 1, err
    assert "Connection closed by peer" not in err.split("hasten: after rank 1 failed")[0], err
    report = err[err.index("hasten: rank 1"):]
    assert 'raise ValueError("boom")' in report and "hasten: after rank 1 failed: rank 0" in report, err
    after = report.split("hasten: after rank 1 failed")[1].strip().splitlines()
    assert "rank 0 (its collective broke" in after[0] and after[1].startswith("hasten: every failed rank's"), err
    assert len(after) == 2, err  # rank 0's consequence in one line, then where the logs are
    # the warnings: hasten's as one line, the user's filter obeyed, the user's own left as Python shows it
    assert "hasten: warning: the quiet test's own warning" in err, err
    assert "HastenWarning" not in err and "silenced by the user" not in err, err
    assert "UserWarning: a user's own warning" in err, err
    # every rank's full traceback stays in the log folder
    kept = {os.path.basename(os.path.dirname(p)): open(p).read() for p in glob.glob(f"{logs}/**/traceback.log",
                                                                                      recursive=True)}
    assert "ValueError: boom" in kept.get("1", ""), kept
    assert "Connection closed by peer" in kept.get("0", "") or "RuntimeError" in kept.get("0", ""), kept


def test_ctrl_c_is_one_line_and_exit_status_130(tmp_path):
    path = tmp_path / "sleep.py"
    path.write_text(SLEEPING)
    proc = _launch([path, tmp_path], tmp_path, start_new_session=True)  # its own group, as a terminal's job
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"up{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to the launcher and every process
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err
    assert err.strip().splitlines() == ["hasten: interrupted (Ctrl-C); stopped 2 processes"], err


WARNING = '''
import warnings
from hasten.warning_kinds import HastenWarning

warnings.warn("hasten says this", HastenWarning)
warnings.warn("the user says this", UserWarning)
with warnings.catch_warnings(record=True) as caught:  # pytest's way of catching still catches it
    warnings.simplefilter("always")
    warnings.warn("caught", HastenWarning)
assert [str(w.message) for w in caught] == ["caught"]
'''


def test_the_wrapper_shows_hasten_warnings_in_one_line_and_obeys_dash_w(tmp_path):
    from hasten.commands.elastic import BOOTSTRAP

    path = tmp_path / "warn.py"
    path.write_text(WARNING)
    env = clean_env(tmp_path / "absent.yaml")
    # `-W` resolves its category before an editable install's import hook is active: name the source
    # folder, as a regular install would make hasten importable at start-up.
    src = os.path.dirname(os.path.dirname(os.path.abspath(hasten.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    shown = subprocess.run([sys.executable, BOOTSTRAP, path], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stderr.splitlines()
    assert lines[0] == "hasten: warning: hasten says this", shown.stderr
    assert "UserWarning: the user says this" in lines[1] and "caught" not in shown.stderr, shown.stderr
    quiet = subprocess.run([sys.executable, "-W", "ignore::hasten.warning_kinds.HastenWarning", BOOTSTRAP, path],
                           env=env, capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and "hasten says this" not in quiet.stderr, quiet.stderr
    assert "UserWarning: the user says this" in quiet.stderr, quiet.stderr
