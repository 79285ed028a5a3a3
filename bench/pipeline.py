"""Pipeline parallelism: step time of PP=2 (hasten, each schedule) against DDP=2 (raw torch), bubble, memory.

    python bench/pipeline.py                        # 8 blocks of 1024x1024, batch 64, microbatches 4 and 8, 3 rounds
    python bench/pipeline.py --rounds 5 --steps 20 --blocks 8 --width 1024 --batch 64 --microbatches 4 8

The same model (``--blocks`` x [Linear(width, width), Tanh], MSE loss, SGD) and the same global batch
(``--batch`` samples per step) trained on 2 CPU processes (gloo, one thread each):

* **DDP=2** (raw PyTorch: ``DistributedDataParallel``): each process runs the whole model on half the
  batch; gradients all-reduced in backward.
* **PP=2** through hasten (``ParallelismConfig(pp_size=2, pp_schedule=S, pp_microbatches=M)``): each
  process runs half the blocks on the whole batch, cut into ``M`` microbatches, by torch's schedule
  ``S``: GPipe, 1F1B, Interleaved1F1B (2 stages per process) and ZBVZeroBubble (2 stages, V-shaped).

Each configuration is one launch of 2 processes (``--warmup`` untimed steps, then ``--steps`` timed
ones: forward + backward + ``optimizer.step`` + ``zero_grad``, median); the launches of a round run
in rotating order and rounds repeat (``--rounds``), so the machine's load drifts over all alike.
Reported: median step time per configuration (median over rounds of each launch's median) and the
ratio PP / DDP (below 1: PP faster), and each rank's CPU time per step (``time.process_time``: this
process's threads, gloo's included; less sensitive than wall time to other jobs on the machine).

Bubble: inside each process, the schedule's compute actions are timed, i.e. torch's
``PipelineStage.forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` (the
stage module's forward, its backward, and the zero-bubble schedules' separate weight-gradient pass).
The measured bubble of a rank is ``1 - busy / wall``, with ``wall`` the time of the schedule step
(``model(x, labels=y)``, which runs every forward and backward) and ``busy`` the time in those actions.
Everything else in the step counts as bubble: waiting for the other stage's activations or
gradients, the sends and receives themselves, the loss, hasten's loss broadcast. Reported per rank
and as the mean of the two ranks, next to the textbook figure (p - 1) / (m + p - 1) for p = 2 processes
and m microbatches (for the interleaved schedules with v stages per process, (p - 1) / (v m + p - 1)).

Memory: each process's peak resident set (``VmHWM`` from ``/proc/self/status``, the kernel's
high-water mark of RSS, which includes the Python interpreter and torch, about 300 MB) over the whole
process, and the peak during the timed steps only (reset with ``/proc/self/clear_refs`` after
prepare and warm-up) minus the RSS just before them: what the training steps add on top of the
weights (activations kept for backward, gradients, buffers).

These are CPU figures (gloo, 2 processes on a small VM): compute is slow relative to communication
there, and say little about GPU runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _procs  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}


def theory(schedule: str, m: int, p: int = 2) -> float:
    v = STAGES_PER_RANK.get(schedule, 1) if schedule == "Interleaved1F1B" else 1
    return (p - 1) / (v * m + p - 1)


def build(blocks: int, width: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])


def worker(out: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rss_start = _procs.rss_mb()
    config = args.config
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    target = batch.tanh()
    loss_fn = torch.nn.functional.mse_loss
    if config == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DistributedDataParallel(build(args.blocks, args.width))
        share = args.batch // world
        x, y = batch[rank * share:(rank + 1) * share], target[rank * share:(rank + 1) * share]
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        stages, timed_part = [], None
    else:
        from hasten import Accelerator
        from hasten.pipeline import pipeline_loss
        from hasten.utils.parallelism_config import ParallelismConfig

        schedule, m = config.split(":")
        acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule=schedule,
                                                               pp_microbatches=int(m)))
        rank = acc.process_index
        model = build(args.blocks, args.width)
        pipeline_loss(model, loss_fn)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, optimizer = acc.prepare(model, optimizer)
        stages = model._pipe_stages
        x, y = batch, target
        timed_part = [0.0]  # seconds inside model(...) (the schedule step)

        def step():
            start = time.perf_counter()
            out = model(x, labels=y)
            timed_part[0] += time.perf_counter() - start
            acc.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    tracker = getattr(model, "_tracker", None)  # hasten's record of the schedule's compute actions (pipeline/tracking.py)
    busy_before = tracker.busy if tracker is not None else 0.0
    if timed_part is not None:
        timed_part[0] = 0.0
    dist.barrier()
    rss_before = _procs.rss_mb()
    reset = _procs.reset_peak_rss()
    times, cpu = [], []
    for _ in range(args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    result = {"config": config, "rank": rank, "step_s": statistics.median(times), "steps": len(times),
              "cpu_s": statistics.median(cpu),
              "rss_start_mb": rss_start, "rss_before_steps_mb": rss_before,
              "peak_steps_mb": _procs.peak_rss_mb() if reset else None}
    import resource

    result["peak_process_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    if timed_part is not None:
        result["schedule_s"] = timed_part[0]
        busy = tracker.busy - busy_before
        result["busy_s"] = busy
        result["bubble"] = 1 - busy / timed_part[0]
        result["params_mb"] = sum(p.numel() * p.element_size() for s in stages for p in s.submod.parameters()) / 1e6
    _procs.write_result(out, result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        _procs.end_worker()
        return
    _procs.header()
    configs = ["ddp"] + [f"{s}:{m}" for m in args.microbatches for s in args.schedules]
    shared = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--blocks", str(args.blocks),
              "--width", str(args.width), "--batch", str(args.batch)]
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    runs: dict[str, list[list[dict]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            runs[config].append(_procs.spawn(os.path.abspath(__file__), ["--config", config, *shared], 2,
                                             extra_path=src))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    ddp = statistics.median(max(rk["step_s"] for rk in run) for run in runs["ddp"])
    rows = []
    for config in configs:
        step = statistics.median(max(rk["step_s"] for rk in run) for run in runs[config])
        row = {"config": "DDP=2 (torch)" if config == "ddp" else f"PP=2 {config.split(':')[0]}",
               "microbatches": None if config == "ddp" else int(config.split(":")[1]),
               "step_ms": step * 1e3, "ratio_to_ddp": step / ddp,
               "cpu_ms": [statistics.median(run[k]["cpu_s"] for run in runs[config]) * 1e3 for k in (0, 1)],
               "peak_process_mb": [max(run[k]["peak_process_mb"] for run in runs[config]) for k in (0, 1)],
               "steps_add_mb": [statistics.median(run[k]["peak_steps_mb"] - run[k]["rss_before_steps_mb"]
                                                  for run in runs[config]) if runs[config][0][k]["peak_steps_mb"]
                                else None for k in (0, 1)]}
        if config != "ddp":
            schedule, m = config.split(":")
            row["bubble_measured"] = [statistics.median(run[k]["bubble"] for run in runs[config]) for k in (0, 1)]
            row["bubble_theory"] = theory(schedule, int(m))
            row["stage_params_mb"] = [runs[config][0][k]["params_mb"] for k in (0, 1)]
        rows.append(row)
    print(f"\n{args.blocks} x Linear({args.width}, {args.width}) + Tanh, global batch {args.batch}, SGD, 2 processes "
          f"(gloo, 1 thread each); median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'configuration':<24}{'m':>3}{'step ms':>10}{'vs DDP':>8}{'CPU ms r0/r1':>14}{'bubble r0/r1 (mean)':>24}"
          f"{'theory':>8}"
          f"{'peak RSS MB r0/r1':>20}{'steps add MB r0/r1':>21}")
    for row in rows:
        bubble = ""
        if "bubble_measured" in row:
            b0, b1 = row["bubble_measured"]
            bubble = f"{b0:.2f}/{b1:.2f} ({(b0 + b1) / 2:.2f})"
        theo = f"{row['bubble_theory']:.2f}" if "bubble_theory" in row else ""
        peak = "/".join(f"{v:.0f}" for v in row["peak_process_mb"])
        add = "/".join("?" if v is None else f"{v:.0f}" for v in row["steps_add_mb"])
        cpu_ms = "/".join(f"{v:.0f}" for v in row["cpu_ms"])
        print(f"{row['config']:<24}{row['microbatches'] or '':>3}{row['step_ms']:>10.1f}{row['ratio_to_ddp']:>8.2f}"
              f"{cpu_ms:>14}{bubble:>24}{theo:>8}{peak:>20}{add:>21}")
    payload = {"model": {"blocks": args.blocks, "width": args.width, "batch": args.batch},
               "rounds": args.rounds, "steps": args.steps, "rows": rows}
    _procs.emit(payload, args.json)
    _procs.footer()


if __name__ == "__main__":
    main()
