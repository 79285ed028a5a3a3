"""What ``hasten.utils.ThroughputMonitor`` costs per step, against the same loop without a monitor and
against Lightning Fabric's ``ThroughputMonitor`` (when ``lightning_fabric`` imports), in the same run.

    python bench/throughput_monitor.py                         # 1 and 2 processes
    python bench/throughput_monitor.py --processes 1 --rounds 9 --steps 300
    python bench/throughput_monitor.py --fabric-path /tmp/lf   # Lightning Fabric from a --target install
    python bench/throughput_monitor.py --quick                 # a smoke test

One training loop (an MLP 64-256-256-1 on batch 64, SGD; DDP over gloo with 2 processes) runs in blocks
of ``--steps`` steps, the contenders in turn inside the same processes, the order reversed every other
round. Each monitored step calls ``update(time=..., batches=..., samples=..., lengths=..., flops...)``;
"@1" calls ``compute_and_log`` every step (the worst case), "@10" every 10th. Each ``compute_and_log``
goes to the framework's log call (``Accelerator.log`` / ``Fabric.log_dict``) and on to one tracker that
keeps the values in memory (a ``GeneralTracker`` / Fabric ``Logger`` subclass), so the logging path is
timed too. hasten's ``compute`` is a collective with several processes (one ``gather_object``: the job's
figures are true sums, the slowest rank is named); Fabric's multiplies process 0's rates by the world
size and exchanges nothing. Reported: the median over rounds of (block - plain block) / steps, in
microseconds (wall clock, the slowest rank); the time spent inside the monitor's own calls per step
(the most direct figure: ``update`` + ``compute_and_log`` timed around the calls, wall clock and CPU
time of the process; CPU time is what stays steady on a shared machine); the added time in CPU time of the process (what the monitor
itself burns; steadier than the wall clock on a shared machine), and the step rate relative to the
plain loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _procs  # noqa: E402

DIM, BATCH, LENGTH = 64, 64, 128  # LENGTH: the items (tokens) one sample counts for


def _trackers() -> tuple[Any, Any]:
    """An in-memory tracker for hasten and a logger for Fabric (None if Fabric does not import)."""
    from hasten.tracking import GeneralTracker

    class MemoryTracker(GeneralTracker):
        name = "memory"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.rows: list = []

        @property
        def tracker(self) -> list:
            return self.rows

        def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
            self.rows.append((step, values))

    try:
        from lightning_fabric.loggers import Logger
    except ImportError:
        return MemoryTracker(), None

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            self.rows: list = []

        name = "memory"
        version = 0

        def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
            self.rows.append((step, metrics))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return MemoryTracker(), MemoryLogger()


def _loop(world: int) -> tuple[Callable[[], None], float]:
    """One training step of a fresh MLP (DDP with 2 processes) and the FLOPs of one batch."""
    import torch
    from torch import nn

    from hasten.utils import measure_flops

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, 1)
    flops = measure_flops(model, lambda: model(x), lambda out: nn.functional.mse_loss(out, y))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step, flops


def _contenders(world: int, every: list[int]) -> tuple[dict[str, Callable[[int], tuple[float, float, float, float]]], list]:
    """name -> run(steps) returning the block's wall and CPU seconds and the wall and CPU
    seconds spent in the monitor's calls (each has its own model and monitor), and
    the trackers the monitors log to."""
    from hasten import Accelerator
    from hasten.utils import ThroughputMonitor

    tracker, logger = _trackers()
    acc = Accelerator(cpu=True, log_with=[tracker])
    acc.init_trackers("bench")
    runs: dict[str, Callable[[int], tuple[float, float, float, float]]] = {}

    def plain() -> Callable[[int], tuple[float, float, float, float]]:
        step, _ = _loop(world)

        def run(steps: int) -> tuple[float, float]:
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            return time.perf_counter() - start, time.process_time() - cpu, 0.0, 0.0
        return run

    def monitored(make: Callable[[], Any], flops_kw: Callable[[float, int], dict], log_every: int):
        step, flops = _loop(world)
        monitor = make()
        done = [0]

        def run(steps: int) -> tuple[float, float, float]:
            start, cpu, inside, inside_cpu = time.perf_counter(), time.process_time(), 0.0, 0.0
            for _ in range(steps):
                step()
                done[0] += 1
                n = done[0]
                before, before_cpu = time.perf_counter(), time.process_time()
                monitor.update(time=before, batches=n, samples=n * BATCH, lengths=n * BATCH * LENGTH,
                               **flops_kw(flops, n))
                if n % log_every == 0:
                    monitor.compute_and_log(step=n)
                inside += time.perf_counter() - before
                inside_cpu += time.process_time() - before_cpu
            return time.perf_counter() - start, time.process_time() - cpu, inside, inside_cpu
        return run

    runs["plain"] = plain()
    for k in every:  # hasten: FLOPs of one batch; Lightning: FLOPs since the previous update (one batch here)
        runs[f"hasten@{k}"] = monitored(lambda: ThroughputMonitor(acc, available_flops=1e12, window_size=50),
                                        lambda f, n: {"flops_per_batch": f}, k)
    if logger is not None:
        from lightning_fabric import Fabric
        from lightning_fabric.utilities.throughput import ThroughputMonitor as FabricMonitor

        fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", loggers=[logger])
        fabric.launch()
        def fabric_monitor() -> Any:
            monitor = FabricMonitor(fabric, window_size=50)
            monitor.available_flops = 1e12  # it takes the peak from its own table only (none for a CPU): MFU too
            return monitor

        for k in every:
            runs[f"fabric@{k}"] = monitored(fabric_monitor, lambda f, n: {"flops": f}, k)
    return runs, [t for t in (tracker, logger) if t is not None]


def worker(out: str, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    runs, trackers = _contenders(world, [1, 10])
    names = list(runs)
    for name in names:  # warm-up: fills the monitors' windows, first calls out of the way
        runs[name](60)
    blocks: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    calls: dict[str, list[float]] = {n: [] for n in names}
    calls_cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if world > 1:
                torch.distributed.barrier()
            wall, used, inside, inside_cpu = runs[name](args.steps)
            blocks[name].append(wall)
            cpu[name].append(used)
            calls[name].append(inside)
            calls_cpu[name].append(inside_cpu)
    # The figures were computed and reached the trackers (MFU included) on the main process.
    logged = [sum(1 for _, values in t.rows if "device/mfu" in values) for t in trackers]
    if int(os.environ.get("RANK", "0")) == 0 and not all(logged):
        raise RuntimeError(f"a monitor logged no MFU: {logged} rows with device/mfu per tracker")
    _procs.write_result(out, {"blocks": blocks, "cpu": cpu, "calls": calls, "calls_cpu": calls_cpu, "steps": args.steps, "logged": logged})


def summarize(results: list[dict]) -> dict[str, dict]:
    """Per contender: median over rounds of the added microseconds per step and of the rate vs plain,
    taking for each round the slowest rank (a collective makes the ranks wait for each other)."""
    steps = results[0]["steps"]
    names = list(results[0]["blocks"])
    rounds = len(results[0]["blocks"]["plain"])
    block = {n: [max(r["blocks"][n][i] for r in results) for i in range(rounds)] for n in names}
    cpu = {n: [max(r["cpu"][n][i] for r in results) for i in range(rounds)] for n in names}
    table = {}
    for name in names:
        added = sorted((b - p) / steps * 1e6 for b, p in zip(block[name], block["plain"]))
        added_cpu = [(b - p) / steps * 1e6 for b, p in zip(cpu[name], cpu["plain"])]
        rate = [p / b for b, p in zip(block[name], block["plain"])]
        inside = statistics.median(max(r["calls"][name][i] for r in results) for i in range(rounds)) / steps * 1e6
        inside_cpu = statistics.median(max(r["calls_cpu"][name][i] for r in results) for i in range(rounds)) / steps * 1e6
        table[name] = {"calls_us": inside, "calls_cpu_us": inside_cpu, "step_us": statistics.median(block[name]) / steps * 1e6, "added_us": statistics.median(added),
                       "added_q": (added[len(added) // 4], added[(3 * len(added)) // 4]),
                       "added_cpu_us": statistics.median(added_cpu), "rate": statistics.median(rate)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, choices=[1, 2], default=None, help="default: 1, then 2")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200, help="steps per block")
    parser.add_argument("--fabric-path", default=None, help="a folder holding lightning_fabric (pip --target)")
    parser.add_argument("--quick", action="store_true", help="1 process, 2 rounds of 20 steps (a smoke test)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        _procs.end_worker()
        return
    if args.quick:
        args.processes, args.rounds, args.steps = 1, 2, 20
    _procs.header()
    forwarded = ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    try:
        import importlib.util

        sys.path.insert(0, args.fabric_path) if args.fabric_path else None
        fabric = importlib.util.find_spec("lightning_fabric") is not None
    finally:
        sys.path.remove(args.fabric_path) if args.fabric_path else None
    if not fabric:
        print("lightning_fabric does not import here: no Fabric column (pass --fabric-path)")
    print(f"MLP 64-256-256-1, batch {BATCH}, SGD; {args.rounds} rounds of {args.steps}-step blocks per contender")
    print("| processes | contender | step µs (median) | in the monitor's calls µs / step, wall / CPU | added µs / step (quartiles) "
          "| added CPU µs / step | rate vs plain |")
    print("|---|---|---|---|---|---|---|")
    for world in ([args.processes] if args.processes else [1, 2]):
        results = _procs.spawn(os.path.abspath(__file__), forwarded, world, extra_path=args.fabric_path)
        for name, row in summarize(results).items():
            print(f"| {world} | {name} | {row['step_us']:.0f} | {row['calls_us']:.1f} / {row['calls_cpu_us']:.1f} | {row['added_us']:+.1f} "
                  f"({row['added_q'][0]:+.1f} to {row['added_q'][1]:+.1f}) | {row['added_cpu_us']:+.1f} | "
                  f"{row['rate']:.3f} |")
    _procs.footer()


if __name__ == "__main__":
    main()
