"""Hang and failure reports of a pipelined run name the stage, the schedule, the step and the action.

Real processes (`hasten launch --cpu --num_processes 2`, pp_size=2, 1F1B): rank 1 breaks inside its
stage's forward at step 2, by raising (a failure report) or by never returning (a hang report). Both
launches start together (on first use), so the module costs about the longer one.
"""


import pytest

from hasten.commands import failures, hangs
from scripts.launch_common import BackgroundLaunch

HANG_TIMEOUT = 6
MARGIN_S = 25  # heartbeat + check interval + stack dumps + shutdown, on a loaded 2-core machine


class Launch(BackgroundLaunch):
    def __init__(self, root, mode):
        super().__init__(root, "launch_pipeline_fail.py", mode, ("--hang_timeout", str(HANG_TIMEOUT)))

    def result(self, timeout=120):
        rc, err = self.finish(timeout)
        start = min(float((self.out / f"hang{r}").read_text()) for r in (0, 1) if (self.out / f"hang{r}").exists())
        return rc, err, self.ended - start


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    started = {mode: Launch(tmp_path_factory.mktemp(f"pp_{mode}"), mode) for mode in ("raise", "hang")}
    yield started
    for launch in started.values():
        if launch.proc.poll() is None:
            launch.proc.kill()
        launch.thread.join(30)


def test_a_stage_that_raises_is_reported_with_its_stage_schedule_and_action(launches):
    rc, err, took = launches["raise"].result()
    assert rc == 1, err
    assert "stage forward broke" in err
    # the failing rank's own traceback ends with where it was
    assert ("hasten: raised in pipeline stage 1 of 2 (process 1 of 2 in the pipeline), schedule 1F1B, during step 2: "
            "forward of microbatch 0 on stage 1") in err, err
    # the other rank: what ended it and where it was in the schedule
    after = next(line for line in err.splitlines() if line.startswith("hasten: after rank 1 failed: rank 0 ("))
    assert "it was in pipeline stage 0 of 2 (process 0 of 2 in the pipeline), schedule 1F1B, during step 2" in after
    assert "microbatch" in after, after
    assert took < MARGIN_S, f"reported {took:.0f} s after step 2 began"


def test_a_stuck_stage_is_reported_with_its_stage_schedule_and_action(launches):
    rc, err, took = launches["hang"].result()
    assert rc == hangs.HANG_EXIT_STATUS, err
    report = err[err.index("hasten: hang:"):]
    rank0 = next(line for line in report.splitlines() if line.startswith("  rank 0 "))
    rank1 = next(line for line in report.splitlines() if line.startswith("  rank 1 "))
    assert "in pipeline stage 0 of 2 (process 0 of 2 in the pipeline), schedule 1F1B, during step 2: " in rank0, rank0
    assert ("in pipeline stage 1 of 2 (process 1 of 2 in the pipeline), schedule 1F1B, during step 2: forward of "
            "microbatch 0 on stage 1") in rank1, rank1
    assert "time.sleep(3600)" in rank1 or "launch_pipeline_fail.py" in rank1, rank1
    assert took < HANG_TIMEOUT + MARGIN_S, f"reported {took:.0f} s after step 2 began"


# -- the text alone (no processes) ---------------------------------------------------------------
def test_describe_rank_shows_the_pipeline_position():
    beat = {"rank": 1, "pid": 7, "steps": 1, "batches": 0, "where": None,
            "pipeline": "pipeline stage 1 of 2 (process 1 of 2 in the pipeline), schedule GPipe, during step 2: "
                        "backward of microbatch 3 on stage 1"}
    line, _ = hangs.describe_rank(beat, 12.0, 0.0)
    assert "step 1, batch 0: elsewhere (not in a collective), in pipeline stage 1 of 2" in line
    assert "schedule GPipe, during step 2: backward of microbatch 3 on stage 1 for 12 s" in line


def test_failure_report_names_the_other_ranks_position():
    first = failures.Failure(rank=1, local_rank=1, node=0, host="h", pid=1, exitcode=1, time=1.0, summary="ValueError: x",
                             traceback="Traceback ...\nValueError: x\nhasten: raised in pipeline stage 1 of 2, "
                                       "schedule 1F1B, during step 2: forward of microbatch 0 on stage 1\n")
    other = failures.Failure(rank=0, local_rank=0, node=0, host="h", pid=2, exitcode=-15, time=2.0, summary="",
                             consequence=True)
    text = failures.report([first, other], positions={0: "pipeline stage 0 of 2, schedule 1F1B, during step 2: "
                                                          "after the forward of microbatch 1 on stage 0"})
    assert "rank 0 (stopped by the launcher; it was in pipeline stage 0 of 2, schedule 1F1B, during step 2" in text
    assert failures.report([first, other]).endswith("rank 0 (stopped by the launcher)")
