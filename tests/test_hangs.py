"""Hangs reported, not waited out: `hasten launch` with real processes (2 ranks, gloo) that hang.

A rank that skips a collective, a rank stuck in its dataset, a straggler, and a healthy run that
starts slowly. Then the watchdog's decisions on heartbeat files written by hand (no processes).

The launches mostly wait (hang timeouts, sleeps), so the module starts every selected one at once
(on first use) and each test reads its own: the module costs about the longest launch, not their sum.
A thread per launch records when it ended, so the time to the report is measured as before.
"""

import json
import os

import pytest

from hasten.commands import hangs
from scripts.launch_common import BackgroundLaunch, clean_env, hasten, ranks

MARGIN_S = 25  # heartbeat + check interval + stack dumps + shutdown, on a loaded 2-core machine

# mode of scripts/launch_hang.py -> (launch flags, extra environment)
SCENARIOS = {
    "skip": (("--hang_timeout", "10"), {}),
    "loader": ((), {"HASTEN_HANG_TIMEOUT": "600"}),  # the script's own setting (8 s) wins
    "setup": (("--hang_timeout", "6"), {}),
    "setup_torch": (("--hang_timeout", "6"), {}),
    "straggler": (("--hang_timeout", "10"), {}),
    "normal": (("--hang_timeout", "5"), {}),
}


@pytest.fixture
def env(tmp_path):
    (tmp_path / "tmp").mkdir()
    return clean_env(tmp_path / "absent.yaml", TMPDIR=tmp_path / "tmp")


class Launch(BackgroundLaunch):
    """One scenario's `hasten launch --cpu --num_processes 2 launch_hang.py MODE OUT`, started now."""

    def __init__(self, root, mode):
        flags, extra = SCENARIOS[mode]
        super().__init__(root, "launch_hang.py", mode, flags, **extra)

    def result(self, timeout=300):
        """(exit status, stderr, the OUT folder, when the launcher exited)."""
        rc, err = self.finish(timeout)
        return rc, err, self.out, self.ended


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """The launches of every selected test of this module (its ``mode`` parameter), started together."""
    modes = sorted({item.callspec.params["mode"] for item in request.session.items
                    if item.module is request.module and "launches" in item.fixturenames})
    started = {mode: Launch(tmp_path_factory.mktemp(f"hang_{mode}"), mode) for mode in modes}
    yield started
    for launch in started.values():
        if launch.proc.poll() is None:
            launch.proc.kill()
        launch.thread.join(30)


def hung_for(out, ended):
    """Seconds from the first rank starting to hang to the launcher's exit."""
    starts = [float((out / f"hang{r}").read_text()) for r in (0, 1) if (out / f"hang{r}").exists()]
    assert starts, f"no rank reached the hang; files: {os.listdir(out)}"
    return ended - min(starts)


def report_of(err):
    assert "hasten: hang:" in err, err
    return err[err.index("hasten: hang:"):]


@pytest.mark.parametrize("mode", ["skip"])
def test_a_rank_that_skips_a_collective_is_reported(launches, mode):
    rc, err, out, ended = launches[mode].result()
    assert rc == hangs.HANG_EXIT_STATUS, err
    report = report_of(err)
    lines = report.splitlines()
    assert "no process made progress for 10 s (hang timeout, command line --hang_timeout)" in lines[0]
    rank0 = next(line for line in lines if line.startswith("  rank 0 "))
    rank1 = next(line for line in lines if line.startswith("  rank 1 "))
    assert "step 4, batch 4" in rank0 and "all_gather(float[2, 3])" in rank0 and "(from hasten gather)" in rank0
    assert "launch_hang.py:" in rank0 and "accelerator.gather(" in rank0
    assert "barrier" in rank1 and "(from hasten wait_for_everyone)" in rank1 and "accelerator.wait_for_everyone()" in rank1
    assert "the ranks are in different collectives" in report and "one rank skipped or added a collective" in report
    stacks = report.split("Python stacks of every thread: ")[1].splitlines()[0].split(", ")
    dumped = open(stacks[1]).read()
    assert "launch_hang.py" in dumped and "wait_for_everyone" in dumped, dumped
    assert "flight recorder" in report
    took = hung_for(out, ended)
    assert took < 10 + MARGIN_S, f"reported {took:.0f} s after the hang began"


@pytest.mark.parametrize("mode", ["loader"])
def test_a_rank_stuck_in_its_dataset_is_reported(launches, mode):
    rc, err, out, ended = launches[mode].result()  # HASTEN_HANG_TIMEOUT=600, the script's own setting (8 s) wins
    assert rc == hangs.HANG_EXIT_STATUS, err
    report = report_of(err)
    assert "no process made progress for 8 s (hang timeout, set by the script)" in report
    rank0 = next(line for line in report.splitlines() if line.startswith("  rank 0 "))
    rank1 = next(line for line in report.splitlines() if line.startswith("  rank 1 "))
    assert "all_reduce(float[5])" in rank0 and "backward: DDP's gradient all-reduce" in rank0
    assert "accelerator.backward(loss)" in rank0
    assert "in the dataloader" in rank1 and "in __getitem__: time.sleep(3600)" in rank1
    assert "rank(s) 0 wait in a collective for rank(s) 1, which never entered it" in report
    took = hung_for(out, ended)
    assert took < 8 + MARGIN_S, f"reported {took:.0f} s after the hang began"


@pytest.mark.parametrize("mode, rank0, rank1", [
    ("setup", "(from hasten reduce)", "(from hasten wait_for_everyone)"),
    ("setup_torch", "all_reduce(float[1]) (from torch.distributed.all_reduce)", "(from torch.distributed.barrier)"),
])
def test_a_hang_before_the_first_step_is_reported(launches, mode, rank0, rank1):
    """No batch, step or backward yet: the clock starts at the first collective a process enters
    (hasten's, or torch.distributed called directly)."""
    rc, err, out, ended = launches[mode].result()
    assert rc == hangs.HANG_EXIT_STATUS, err
    report = report_of(err)
    assert "no process made progress for 6 s" in report.splitlines()[0]
    rank0_line = next(line for line in report.splitlines() if line.startswith("  rank 0 "))
    rank1_line = next(line for line in report.splitlines() if line.startswith("  rank 1 "))
    assert "step 0, batch 0: in collective #" in rank0_line and rank0 in rank0_line, rank0_line
    assert "step 0, batch 0: in collective #" in rank1_line and rank1 in rank1_line, rank1_line
    assert "the ranks are in different collectives" in report
    took = hung_for(out, ended)
    assert took < 6 + MARGIN_S, f"reported {took:.0f} s after the hang began"


@pytest.mark.parametrize("mode", ["straggler"])
def test_a_straggler_is_a_warning(launches, mode):
    rc, err, out, _ = launches[mode].result()
    assert rc == 0, err
    assert [r["steps"] for r in ranks(out, 2)] == [60, 60]
    warnings = [line for line in err.splitlines() if "straggler" in line]
    assert len(warnings) == 1 and warnings[0].startswith("hasten: warning: rank 1 is a straggler: "), err
    own = float(warnings[0].split("straggler: ")[1].split(" s of its own work")[0])
    assert 0.25 < own < 0.6, warnings[0]  # it sleeps 0.3 s per step
    assert "hasten: hang" not in err


@pytest.mark.parametrize("mode", ["normal"])
def test_a_healthy_run_that_starts_slowly_is_left_alone(launches, mode):
    rc, err, out, _ = launches[mode].result()
    assert rc == 0, err
    assert [r["steps"] for r in ranks(out, 2)] == [30, 30]
    assert "hang" not in err and "straggler" not in err, err
    assert not [n for n in os.listdir(launches[mode].tmp) if n.startswith("hasten-hang-")]  # removed: nothing hung


# -- the watchdog on hand-written heartbeats ------------------------------------------------------
def beat(folder, rank, **fields):
    data = {"rank": rank, "pid": None, "ticks": 0, "changes": 1, "steps": 0, "batches": 0, "sync_s": 0.0, "t": 0.0,
            "done": False}
    data.update(fields)
    (folder / f"beat{rank}.json").write_text(json.dumps(data))


class Watched:
    def __init__(self, folder, timeout=10.0, processes=2):
        self.stopped, self.warnings = [], []
        self.dog = hangs.Watchdog(str(folder), timeout, "test", processes, stop=lambda: self.stopped.append(1),
                                  warn=self.warnings.append)


def test_the_timer_starts_at_the_first_progress_mark(tmp_path, monkeypatch):
    monkeypatch.setattr(hangs, "DUMP_WAIT_S", 0.1)
    w = Watched(tmp_path)
    for r in (0, 1):
        beat(tmp_path, r)
    assert not w.dog.check(0.0) and not w.dog.check(1000.0)  # no mark yet: a slow start is not a hang
    beat(tmp_path, 0, ticks=1)
    assert not w.dog.check(1001.0)
    assert not w.dog.check(1010.5)
    beat(tmp_path, 1, changes=2)  # rank 1 moved to another line: alive
    assert not w.dog.check(1011.0)
    assert w.dog.check(1021.5) and w.stopped == [1]
    assert "no process made progress for 10 s" in w.dog.report


def test_the_timer_starts_at_the_first_collective_entered(tmp_path, monkeypatch):
    monkeypatch.setattr(hangs, "DUMP_WAIT_S", 0.1)
    w = Watched(tmp_path)
    beat(tmp_path, 0)
    beat(tmp_path, 1)
    assert not w.dog.check(0.0) and not w.dog.check(500.0)  # the process group is up, no collective yet
    beat(tmp_path, 1, entered=True)  # e.g. a direct torch.distributed.barrier(): no progress mark
    assert not w.dog.check(501.0) and not w.dog.check(510.5)
    assert w.dog.check(511.5) and "no process made progress for 10 s" in w.dog.report


def test_finished_ranks_are_not_waited_for_and_the_script_setting_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(hangs, "DUMP_WAIT_S", 0.1)
    w = Watched(tmp_path, timeout=300)
    beat(tmp_path, 0, ticks=5, hang_timeout=20.0, where="gather")
    beat(tmp_path, 1, ticks=5, done=True)
    w.dog.check(0.0)
    assert not w.dog.check(15.0)
    assert w.dog.check(20.5)
    report = w.dog.report
    assert "20 s (hang timeout, set by the script)" in report and "rank 1: finished its script" in report
    assert "rank 0 (pid None): step 0, batch 0: in hasten's gather" in report


def test_a_script_can_turn_the_check_off(tmp_path):
    w = Watched(tmp_path)
    beat(tmp_path, 0, ticks=1, hang_timeout=0.0)
    beat(tmp_path, 1, ticks=1)
    w.dog.check(0.0)
    assert not w.dog.check(10_000.0) and w.stopped == []


def test_straggler_needs_three_times_the_median_of_the_others(tmp_path):
    w = Watched(tmp_path, processes=3)
    for r in range(3):
        beat(tmp_path, r, ticks=1, steps=1, t=0.0)
    w.dog.check(0.0)
    w.dog.check(1.0)  # window starts
    # 10 s, 20 steps: rank 2 works 0.4 s/step, ranks 0 and 1 work 0.1 s/step (the rest is waiting).
    beat(tmp_path, 0, ticks=21, steps=21, t=10.0, sync_s=8.0)
    beat(tmp_path, 1, ticks=21, steps=21, t=10.0, sync_s=8.0)
    beat(tmp_path, 2, ticks=21, steps=21, t=10.0, sync_s=2.0)
    w.dog.check(11.5)
    assert len(w.warnings) == 1 and w.warnings[0].startswith("hasten: warning: rank 2 is a straggler: 0.400 s")
    assert "vs 0.100 s on the other ranks" in w.warnings[0]
    beat(tmp_path, 2, ticks=41, steps=41, t=20.0, sync_s=4.0)
    w.dog.check(22.0)
    assert len(w.warnings) == 1  # once per rank


def test_cuda_runs_get_the_nccl_flight_recorder():
    env = hangs.child_env("/x", "cuda", environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"})
    assert env["HASTEN_HANG_DIR"] == "/x" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/x/nccl_trace_rank_" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in hangs.child_env("/x", "cpu", environ={})


def test_hang_timeout_setting(tmp_path, env):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("hang_timeout: 42\n")
    (tmp_path / "x.py").write_text("")
    rc, out, err, _ = hasten(["launch", "--dry_run", "--config_file", cfg, "--cpu", "--num_processes", "2", "x.py"],
                             env, cwd=tmp_path)
    assert rc == 0, err
    assert any(line.split()[:2] == ["hang_timeout", "42.0"] and "cfg.yaml: hang_timeout" in line
               for line in out.splitlines()), out
    rc, out, err, _ = hasten(["launch", "--hang_timeout", "-1", "x.py"], env, cwd=tmp_path)
    assert rc == 2 and err.count("\n") == 1 and "--hang_timeout" in err and "at least 0" in err, err
