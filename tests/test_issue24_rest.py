"""Issue 24's remaining items. On 2 real processes (checks in checks_issue24_rest.py): DeepSpeed
clipping set by clip_grad_norm_ (item 2), a save hook failing on one process (item 11). In this
process: straggler timing by device events (item 9), the scheduler's reads of fp16 skip flags (item 7)."""

import importlib.util

import pytest

from distributed import run_checks

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_issue24_rest", world_size=2, timeout=400)


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])  # ZeRO-1 clips in ZeRO-2's optimizer class
def test_deepspeed_clip_grad_norm_without_gradient_clipping_clips_through_the_engine(two, stage):
    values = two.assert_passed(f"check_zero{stage}_clip_grad_norm_without_gradient_clipping")
    assert values[0]["norms"] == values[1]["norms"]


@needs_deepspeed
def test_deepspeed_clipping_follows_each_calls_max_norm(two):
    two.assert_passed("check_zero2_clip_follows_each_call")


def test_a_save_hook_failing_on_one_process_cannot_leave_another_in_a_collective(two):
    values = two.assert_passed("check_save_hook_failing_on_one_process_is_agreed_before_a_collective_hook")
    assert values[0]["message"] == values[1]["message"]


# -- item 9: straggler timing of an asynchronous device -----------------------------------------
class FakeDevice:
    """A device running behind the host: an event completes when the test says the device reached it."""

    def __init__(self):
        self.queued = []

    def record(self):
        event = FakeEvent()
        self.queued.append(event)
        return event

    def reach(self, *times):
        for t in times:
            self.queued.pop(0).at = t


class FakeEvent:
    """Only what the timer may use of torch.cuda.Event: query() and elapsed_time() (milliseconds)."""

    def __init__(self):
        self.at = None

    def query(self):
        return self.at is not None

    def elapsed_time(self, end):
        assert self.at is not None and end.at is not None, "read before the device reached the event: a host sync"
        return (end.at - self.at) * 1000.0


@pytest.fixture
def device_timer():
    from hasten import progress

    device = FakeDevice()
    progress.time_device_work(device.record)
    yield device
    progress.time_device_work(None)


def test_device_work_is_timed_by_events_read_once_complete(device_timer):
    from hasten import progress

    def phase(where):
        progress.leave(progress.enter(where))

    start = progress.snapshot()["work_s"]
    phase(progress.BACKWARD)  # its end opens a work segment (event 1)
    inner = progress.enter("gather")  # closes it (event 2); nested phases are one phase
    progress.leave(progress.enter("gather_object"))
    progress.leave(inner)  # opens the next segment (event 3)
    assert len(device_timer.queued) == 3
    assert progress.snapshot()["work_s"] == start  # the device has not reached the events: nothing read, no wait
    device_timer.reach(10.0, 10.25)  # the device ran the segment's kernels in 0.25 s
    phase(progress.BACKWARD)  # closes segment 2 (event 4), reads segment 1, opens segment 3 (event 5)
    assert progress.snapshot()["work_s"] - start == pytest.approx(0.25)
    device_timer.reach(11.0, 11.5, 12.0)
    phase(progress.BACKWARD)
    assert progress.snapshot()["work_s"] - start == pytest.approx(0.75)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_events_time_the_work_without_a_host_sync():
    """The real path on a GPU: phase boundaries under sync debug mode "error" never sync; the
    segment's device time is read once the GPU has passed it."""
    import torch

    from hasten import progress
    from hasten.accelerator import _recorded_cuda_event

    progress.time_device_work(_recorded_cuda_event)
    try:
        a = torch.randn(2048, 2048, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            progress.leave(progress.enter(progress.BACKWARD))
            for _ in range(20):
                a = (a @ a).tanh()  # work outside any sync phase
            progress.leave(progress.enter(progress.BACKWARD))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        progress.leave(progress.enter(progress.BACKWARD))  # reads the finished segment
        assert progress.snapshot()["work_s"] > 0
    finally:
        progress.time_device_work(None)


def test_without_a_device_timer_work_is_host_time():
    from hasten import progress

    assert progress.snapshot()["work_s"] is None  # CPU: the launcher keeps wall time minus sync time


def test_the_straggler_check_uses_device_work_when_the_ranks_report_it(tmp_path):
    import test_hangs

    w = test_hangs.Watched(tmp_path)
    for r in range(2):
        test_hangs.beat(tmp_path, r, ticks=1, steps=1, t=0.0, work_s=0.0)
    w.dog.check(0.0)
    w.dog.check(1.0)
    # Host timing sees the same 0.1 s per step on both (asynchronous kernels return at once); the
    # device says rank 1 works 0.4 s per step while rank 0's stream waits for it inside backward.
    test_hangs.beat(tmp_path, 0, ticks=21, steps=21, t=10.0, sync_s=8.0, work_s=2.0)
    test_hangs.beat(tmp_path, 1, ticks=21, steps=21, t=10.0, sync_s=8.0, work_s=8.0)
    w.dog.check(11.5)
    assert len(w.warnings) == 1 and w.warnings[0].startswith("hasten: warning: rank 1 is a straggler: 0.400 s"), \
        w.warnings
    assert "vs 0.100 s on the other ranks" in w.warnings[0]


# -- item 7 (the scheduler): the fp16 skip flags are read once, when the scheduler asks ------------
def _two_fp16_optimizers():
    import torch

    from hasten import Accelerator, GradScalerKwargs

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (first, second)]
    first, second, *opts = acc.prepare(first, second, *opts)
    return acc, first, second, opts


@pytest.mark.parametrize("overflow", [False, True])
def test_the_scheduler_reads_the_fp16_skip_flags_of_its_optimizers_once(fresh_state, overflow):
    import torch

    import test_fp16_scaler
    from hasten.scheduler import AcceleratedScheduler

    acc, first, second, (opt_a, opt_b) = _two_fp16_optimizers()
    # A scheduler that follows both optimizers (prepare gives it every optimizer when its own is not prepared).
    sched = AcceleratedScheduler(torch.optim.lr_scheduler.LambdaLR(opt_a.optimizer, lambda s: 0.5 ** s),
                                 [opt_a, opt_b])
    acc.backward(second(first(torch.randn(4, 8, device=acc.device))).pow(2).mean())
    if overflow:
        second.weight.grad[0, 0] = float("inf")
    with test_fp16_scaler._HostReads() as steps:
        opt_a.step()
        opt_b.step()
    assert steps.calls == []  # the optimizers leave their verdicts on the device
    with test_fp16_scaler._HostReads() as asked:
        sched.step()
    assert asked.calls == ["__bool__"], asked.calls  # one read for both optimizers: one host sync on CUDA
    assert sched.get_last_lr() == ([1e-2] if overflow else [5e-3])
    assert opt_b.step_was_skipped is overflow and not opt_a.step_was_skipped


def test_without_fp16_the_scheduler_reads_nothing(fresh_state):
    import torch

    import test_fp16_scaler
    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, sched = acc.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    acc.backward(model(torch.randn(2, 4, device=acc.device)).sum())
    with test_fp16_scaler._HostReads() as reads:
        opt.step()
        sched.step()
    assert reads.calls == [] and sched.get_last_lr() == [0.05]
