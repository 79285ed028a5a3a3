"""Throughput you can see: measure_flops against a hand count, Throughput's window, MFU, the peak table,
ThroughputMonitor's job figures on 2 real processes (one slow on purpose), trackers, and the launcher's
summary line."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from devices import launch_flags, reference_device
from distributed import reset_state, run_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _linear_stack(device) -> nn.Module:
    with torch.device(device):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# A matmul of (B x n) by (n x m) is B*n*m multiply-adds = 2*B*n*m FLOPs. Forward: one per layer. Backward:
# the weight gradient of every layer, and the input gradient of every layer but the first (the batch itself
# needs no gradient). Bias adds, ReLU and the loss are not matmuls: the counter leaves them out.
BATCH = 3
FORWARD = 2 * BATCH * (8 * 16 + 16 * 4)
BACKWARD = 2 * BATCH * (8 * 16 + 16 * 4) + 2 * BATCH * 16 * 4


def test_measure_flops_matches_a_hand_count_on_meta_and_real_models():
    from hasten.utils import measure_flops

    meta = _linear_stack("meta")
    x = torch.randn(BATCH, 8, device="meta")
    assert measure_flops(meta, lambda: meta(x)) == FORWARD
    assert measure_flops(meta, lambda: meta(x), lambda y: y.sum()) == FORWARD + BACKWARD

    real = _linear_stack(reference_device())
    before = [p.detach().clone() for p in real.parameters()]
    x = torch.randn(BATCH, 8, device=reference_device())
    assert measure_flops(real, lambda: real(x), lambda y: y.pow(2).mean()) == FORWARD + BACKWARD
    assert all(p.grad is None for p in real.parameters())  # measuring leaves no gradients behind
    assert all(torch.equal(a, p) for a, p in zip(before, real.parameters()))


def test_measure_flops_of_a_transformers_model_built_on_meta():
    """A GPT-2 from a config: per token and layer the four projections are 12*d*d multiply-adds, the head d*V;
    attention adds Q.K^T and A.V, 2*T*d each per token and layer. Backward is twice forward (the embedding
    has weights, so even the first layer's input gets a gradient). Meta and real weights count the same."""
    transformers = pytest.importorskip("transformers")
    from hasten.utils import measure_flops

    batch, seq, width, layers, vocab = 4, 32, 64, 2, 256
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq,
                                     bos_token_id=0, eos_token_id=0)
    forward = 2 * batch * seq * (layers * 12 * width * width + width * vocab) + layers * 4 * batch * seq * seq * width
    counts = []
    for device in ("meta", reference_device()):
        with torch.device(device):
            model = transformers.GPT2LMHeadModel(config)
            ids = torch.randint(0, vocab, (batch, seq))
        counts.append(measure_flops(model, lambda: model(ids, labels=ids), lambda out: out.loss))
    assert counts == [3 * forward, 3 * forward]


def test_mfu_from_measured_flops_and_an_injected_clock():
    from hasten.utils import Throughput, measure_flops

    meta = _linear_stack("meta")
    x = torch.randn(BATCH, 8, device="meta")
    flops = measure_flops(meta, lambda: meta(x), lambda y: y.sum())
    peak = 1e6
    throughput = Throughput(available_flops=peak, world_size=2, window_size=3)
    for i, now in enumerate([10.0, 10.25, 10.5], start=1):
        throughput.update(time=now, batches=i, samples=i * BATCH, flops_per_batch=flops)
    metrics = throughput.compute()
    # two batches after the window's first time stamp, in 0.5 s
    assert metrics["device/flops_per_sec"] == pytest.approx(2 * (FORWARD + BACKWARD) / 0.5, rel=1e-12)
    assert metrics["device/mfu"] == pytest.approx(metrics["device/flops_per_sec"] / peak, rel=1e-12)
    assert metrics["flops_per_sec"] == pytest.approx(2 * metrics["device/flops_per_sec"], rel=1e-12)
    assert metrics["mfu"] == pytest.approx(metrics["flops_per_sec"] / (peak * 2), rel=1e-12)
    assert metrics["device/samples_per_sec"] == pytest.approx(2 * BATCH / 0.5)


def test_window_rates_step_times_and_bad_input():
    from hasten.utils import Throughput

    throughput = Throughput(window_size=3)
    throughput.update(time=1.0, batches=1, samples=4, lengths=40)
    throughput.update(time=2.0, batches=2, samples=8, lengths=80)
    early = throughput.compute()
    assert early["batches"] == 2 and early["samples"] == 8 and early["lengths"] == 80 and early["time"] == 2.0
    assert "device/batches_per_sec" not in early  # the window is not full yet
    throughput.update(time=3.0, batches=3, samples=12, lengths=120)
    full = throughput.compute()
    assert full["device/batches_per_sec"] == 1.0 and full["device/samples_per_sec"] == 4.0
    assert full["device/items_per_sec"] == 40.0 and "batches_per_sec" not in full  # one process: no job keys
    throughput.update(time=3.5, batches=4, samples=16, lengths=160)  # the window slides: 1.0 falls out
    assert throughput.compute()["device/batches_per_sec"] == pytest.approx(2 / 1.5)

    steps = Throughput(window_size=5)
    for i, now in enumerate([0.0, 1.0, 3.0, 4.0, 10.0], start=1):
        steps.update(time=now, batches=i, samples=i)
    times = steps.compute()
    assert times["device/step_time_median"] == 1.5  # steps 1, 2, 1, 6
    assert times["device/step_time_p90"] == pytest.approx(4.8)  # between 2 and 6, 0.7 of the way

    with pytest.raises(ValueError, match="time"):
        steps.update(time=9.0, batches=6, samples=6)
    with pytest.raises(ValueError, match="window_size"):
        Throughput(window_size=1)
    with pytest.raises(ValueError, match="lengths"):
        mixed = Throughput(window_size=2)
        mixed.update(time=1.0, batches=1, samples=1)
        mixed.update(time=2.0, batches=2, samples=2, lengths=5)
    steps.reset()
    assert steps.compute() == {}


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5e12),
    ("NVIDIA H100 PCIe", torch.float16, 756.5e12),
    ("NVIDIA H100 NVL", torch.bfloat16, 835.5e12),
    ("NVIDIA H200", torch.bfloat16, 989.5e12),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
    ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
    ("NVIDIA B200", torch.bfloat16, 2.25e15),
    ("AMD Instinct MI300X", torch.bfloat16, 1307.4e12),
    ("NVIDIA L4", torch.bfloat16, 121e12),
    ("NVIDIA L40S", torch.bfloat16, 362.05e12),
    ("NVIDIA A10G", torch.bfloat16, 125e12),
    ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bfloat16 on Volta
    ("NVIDIA GeForce GT 710", torch.float32, None),
])
def test_peak_flops_table(name, dtype, expected):
    from hasten.utils import peak_flops

    assert peak_flops(name, dtype) == expected


def test_monitor_peak_from_argument_and_environment(monkeypatch):
    from hasten import Accelerator
    from hasten.utils import ThroughputMonitor

    reset_state()
    acc = Accelerator()
    assert ThroughputMonitor(acc, available_flops=3e12).available_flops == 3e12
    monkeypatch.setenv("HASTEN_AVAILABLE_FLOPS", "2e12")
    assert ThroughputMonitor(acc).available_flops == 2e12
    monkeypatch.setenv("HASTEN_AVAILABLE_FLOPS", "fast")
    with pytest.raises(ValueError, match="HASTEN_AVAILABLE_FLOPS"):
        ThroughputMonitor(acc)
    with pytest.raises(ValueError, match="available_flops"):
        ThroughputMonitor(acc, available_flops=-1)
    reset_state()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    summary = str(tmp_path_factory.mktemp("throughput") / "summary.json")
    return run_checks("checks_throughput", world_size=2, timeout=180, env={"HASTEN_THROUGHPUT_SUMMARY": summary})


JOB_KEYS = ("batches_per_sec", "samples_per_sec", "items_per_sec", "flops_per_sec", "mfu", "step_time_median",
            "step_time_p90", "slowest_rank", "peak_memory_bytes")


def test_job_figures_sum_the_processes_and_name_the_slow_one(two_ranks):
    fast, slow = two_ranks.assert_passed("check_world_figures_and_slowest_rank")
    # rank 0: 2 batches of 2 samples in 0.2 s; rank 1: in 0.8 s; 6000 FLOPs a batch; 1e9 FLOP/s a device
    assert fast["device/samples_per_sec"] == pytest.approx(20) and slow["device/samples_per_sec"] == pytest.approx(5)
    assert slow["device/mfu"] == pytest.approx(2 * 6000 / 0.8 / 1e9)
    for metrics in (fast, slow):
        assert metrics["batches_per_sec"] == pytest.approx(12.5)
        assert metrics["samples_per_sec"] == pytest.approx(25) and metrics["items_per_sec"] == pytest.approx(125)
        assert metrics["flops_per_sec"] == pytest.approx(6000 * 12.5)
        assert metrics["mfu"] == pytest.approx(6000 * 12.5 / (1e9 * 2))
        assert metrics["slowest_rank"] == 1
        assert metrics["step_time_median"] == pytest.approx(0.4) and metrics["step_time_p90"] == pytest.approx(0.4)
        assert metrics["peak_memory_bytes"] >= max(fast["device/peak_memory_bytes"], slow["device/peak_memory_bytes"])
    assert {k: fast[k] for k in JOB_KEYS} == {k: slow[k] for k in JOB_KEYS}


def test_unequal_ranks_meet_and_agree(two_ranks):
    (first0, second0), (first1, second1) = two_ranks.assert_passed("check_unequal_ranks_do_not_hang")
    assert "device/samples_per_sec" in first0 and "device/samples_per_sec" not in first1 and "time" not in first1
    for first, second in ((first0, first1), (second0, second1)):
        shared = {k: v for k, v in first.items() if k in JOB_KEYS}
        assert shared == {k: v for k, v in second.items() if k in JOB_KEYS}
        assert "samples_per_sec" not in first  # a process without a full window: no job rates, on every process
    assert first0["slowest_rank"] == 0 and second0["slowest_rank"] == 1
    assert second0["step_time_median"] == pytest.approx(0.2)


def test_misaligned_compute_raises_the_same_error_everywhere(two_ranks):
    zero, one = two_ranks.assert_passed("check_misaligned_calls_raise_on_every_rank")
    assert zero == one and "step" in zero and "10" in zero and "11" in zero


def test_compute_and_log_reaches_the_trackers_and_the_summary_file(two_ranks):
    main, other = two_ranks.assert_passed("check_log_to_tracker_and_summary_file")
    assert other["logged"] == []  # the tracker runs on the main process only
    (entry,) = main["logged"]
    assert entry["step"] == 7 and entry["values"] == main["returned"]
    assert entry["values"]["samples_per_sec"] == pytest.approx(30) and entry["values"]["slowest_rank"] == 1
    summary = main["summary"]
    assert summary["processes"] == 2 and summary["samples_per_sec"] == pytest.approx(30)
    assert summary["slowest_rank"] == 1 and summary["mfu"] == pytest.approx(entry["values"]["mfu"])


def test_summary_line_without_a_monitor():
    from hasten.commands.run_summary import summary_line

    assert summary_line(2, 3.04, None) == "hasten: 2 processes, wall 3.0 s"
    line = summary_line(2, 61.0, {"samples_per_sec": 1234.5, "items_per_sec": 5e4, "flops_per_sec": 2.5e12,
                                  "mfu": 0.4123, "step_time_median": 0.0123, "step_time_p90": 0.015,
                                  "slowest_rank": 1, "peak_memory_bytes": 3 * 2**30})
    assert line == ("hasten: 2 processes, wall 61.0 s; 1,234 samples/s, 50,000 items/s, 2.5 TFLOP/s, MFU 41.2%, "
                    "step 12.3 ms median, 15.0 ms p90 (slowest: rank 1), peak memory 3.00 GiB")


def test_example_under_the_launcher_prints_the_summary_line(tmp_path):
    example = os.path.join(ROOT, "examples", "throughput.py")
    env = dict(os.environ, HASTEN_AVAILABLE_FLOPS="1e11")
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", *launch_flags(2),
                          "--num_processes", "2", example, "--steps", "12"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("hasten: 2 processes, wall ")]
    assert len(lines) == 1, out.stdout + out.stderr
    assert re.search(r"items/s, .*FLOP/s, MFU [\d.]+%, step [\d.]+ ms median, [\d.]+ ms p90 \(slowest: rank [01]\)",
                     lines[0]), lines[0]
    printed = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("metrics ")]
    assert printed and printed[-1]["mfu"] > 0 and printed[-1]["device/flops_per_sec"] > 0, out.stdout


def test_lightning_flops_argument_counts_work_since_the_previous_update():
    """Lightning's ``update(flops=...)`` is the FLOPs since the previous update; it gives the same
    figures as ``flops_per_batch`` times the batches run, and the two together are refused."""
    from hasten.utils import Throughput

    per_batch = 1e9
    lightning, ours = Throughput(available_flops=1e12, window_size=4), Throughput(available_flops=1e12, window_size=4)
    batches = 0
    for now, run in zip([1.0, 1.5, 2.5, 3.0], [1, 2, 3, 1]):
        batches += run
        lightning.update(time=now, batches=batches, samples=4 * batches, flops=per_batch * run)
        ours.update(time=now, batches=batches, samples=4 * batches, flops_per_batch=per_batch)
    assert lightning.compute() == ours.compute()
    assert lightning.compute()["device/flops_per_sec"] == pytest.approx(6 * per_batch / 2.0, rel=1e-12)
    with pytest.raises(ValueError, match="not both"):
        Throughput().update(time=1.0, batches=1, samples=1, flops=1.0, flops_per_batch=1.0)


def test_one_process_writes_the_summary_file_only_when_the_launcher_asks(tmp_path, monkeypatch):
    """One process: compute() skips the job's figures unless ``hasten launch`` named a summary file;
    when it did, the file holds the job figures with ``processes: 1`` (that path is not a collective)."""
    from hasten import Accelerator
    from hasten.utils import ThroughputMonitor

    reset_state()
    monkeypatch.delenv("HASTEN_THROUGHPUT_SUMMARY", raising=False)
    acc = Accelerator()
    held = torch.ones(1024, device=acc.device)  # so the peak is above 0 on an accelerator too
    monitor = ThroughputMonitor(acc, available_flops=1e9, window_size=3)
    for i in range(1, 5):
        monitor.update(time=0.1 * i, batches=i, samples=2 * i, lengths=10 * i, flops_per_batch=6000)
    quiet = monitor.compute()
    assert not list(tmp_path.iterdir())
    summary = tmp_path / "summary.json"
    monkeypatch.setenv("HASTEN_THROUGHPUT_SUMMARY", str(summary))
    assert monitor.compute() == quiet  # the same figures for the process; one process gets no job keys
    written = json.loads(summary.read_text())
    assert written["processes"] == 1 and written["slowest_rank"] == 0
    assert written["samples_per_sec"] == pytest.approx(20) and written["mfu"] == pytest.approx(6000 * 10 / 1e9)
    assert written["step_time_median"] == pytest.approx(0.1) and written["peak_memory_bytes"] > 0
    assert "samples_per_sec" not in quiet and quiet["device/samples_per_sec"] == pytest.approx(20)
    del held
    reset_state()


def test_window_figures_equal_a_recount_of_the_last_updates_after_many_updates_and_a_reset():
    """The window keeps running totals and its step times in order as updates come and go; its figures must
    equal those counted afresh from the last ``window_size`` updates (times and FLOPs varying every step)."""
    import random

    from hasten.utils.throughput import Throughput, percentile

    rng = random.Random(0)
    meter = Throughput(window_size=7)
    time = batches = samples = 0
    history = []
    for step in range(60):
        if step == 31:
            meter.reset()
            history.clear()
        time += rng.uniform(0.01, 0.5)
        batches += rng.randint(1, 3)
        samples += rng.randint(1, 9)
        flops = rng.uniform(1e3, 1e6)
        meter.update(time=time, batches=batches, samples=samples, flops=flops)
        history.append((time, batches, samples, flops))
        last = history[-7:]
        window = meter.window()
        steps = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(last, last[1:])]
        assert window.full == (len(last) == 7)
        assert window.elapsed == pytest.approx(last[-1][0] - last[0][0], rel=1e-12)
        assert (window.batches, window.samples) == (last[-1][1] - last[0][1], last[-1][2] - last[0][2])
        assert window.flops == pytest.approx(sum(f for *_, f in last[1:]), rel=1e-9)
        if steps:
            assert window.step_time_median == pytest.approx(percentile(steps, 0.5), rel=1e-12)
            assert window.step_time_p90 == pytest.approx(percentile(steps, 0.9), rel=1e-12)
        else:
            assert window.step_time_median is None
