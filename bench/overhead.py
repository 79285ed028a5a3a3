"""Per-step framework overhead: raw PyTorch vs hasten (vs Accelerate when installed).

    python bench/overhead.py                 # 1 and 2 processes, both workloads
    python bench/overhead.py --procs 2 --rounds 9 --steps 400
    python bench/overhead.py --watch         # with what `hasten launch` adds: heartbeat + flight recorder

The same training loop (dataloader -> forward -> backward -> step -> zero_grad) runs in each
implementation inside the same processes, interleaved round by round in a rotating order, so
machine noise hits all of them alike. Reported: median per-step time, and per implementation the
median over rounds of (its time - raw time) / steps, i.e. the overhead it adds in microseconds.
Workloads: "null" = Linear(8, 1) on batch 8 (all framework, no compute) and "mlp" = a small MLP.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def build(workload: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if workload == "null":
        return (lambda: nn.Linear(8, 1)), 8, 8
    return (lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                  nn.Linear(256, 1))), 64, 64


def make_loader(dim: int, batch: int, steps: int, world: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n = batch * steps * world
    data = TensorDataset(torch.randn(n, dim), torch.randn(n, 1))
    return DataLoader(data, batch_size=batch, shuffle=True)


def raw_runner(factory, dim, batch, steps, world):
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    model = factory()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    base = make_loader(dim, batch, steps, world)
    sampler = DistributedSampler(base.dataset, seed=0) if world > 1 else None
    dl = DataLoader(base.dataset, batch_size=batch, sampler=sampler, shuffle=sampler is None)
    device = torch.device("cpu")
    epoch = [0]

    def run():
        if sampler is not None:
            sampler.set_epoch(epoch[0])
        epoch[0] += 1
        for x, y in dl:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return run


def framework_runner(accelerator, factory, dim, batch, steps, world):
    import torch

    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt, dl = accelerator.prepare(model, opt, make_loader(dim, batch, steps, world))

    def run():
        for x, y in dl:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()

    return run


def start_watch() -> None:
    """What `hasten launch` runs in each process: the heartbeat thread (the flight recorder is on via env)."""
    import importlib.util

    path = os.path.join(HERE, "..", "src", "hasten", "commands", "_heartbeat.py")
    spec = importlib.util.spec_from_file_location("_hasten_heartbeat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.start(os.environ["HASTEN_HANG_DIR"])


def worker(args) -> None:
    if os.environ.get("HASTEN_HANG_DIR"):
        start_watch()
    import torch

    torch.set_num_threads(1)
    from hasten import Accelerator
    from hasten.state import PartialState

    state = PartialState(cpu=True)
    world = state.num_processes
    results = {}
    for workload in args.workloads.split(","):
        factory, dim, batch = build(workload)
        runners = {"raw": raw_runner(factory, dim, batch, args.steps, world)}
        runners["hasten"] = framework_runner(Accelerator(cpu=True), factory, dim, batch, args.steps, world)
        try:
            import accelerate

            runners["accelerate"] = framework_runner(accelerate.Accelerator(cpu=True), factory, dim, batch,
                                                     args.steps, world)
        except ImportError:
            pass
        names = list(runners)
        times = {n: [] for n in names}
        for n in names:  # warm-up
            runners[n]()
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                state.wait_for_everyone()
                t0 = time.perf_counter()
                runners[n]()
                state.wait_for_everyone()
                times[n].append(time.perf_counter() - t0)
        results[workload] = times
    if state.is_main_process:
        with open(args.out, "w") as f:
            json.dump(results, f)
    state.destroy_process_group()


def launch(nproc: int, args) -> dict:
    out = tempfile.mktemp(suffix=".json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, watched = [], []
    for rank in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if args.watch:
            watched.append(tempfile.mkdtemp(prefix="bench-hang-"))
            env.update(HASTEN_HANG_DIR=watched[-1], TORCH_FR_BUFFER_SIZE="2000")
        if nproc > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, __file__, "--worker", "--out", out, "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--workloads", args.workloads]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        p.wait()
    if args.watch:
        import shutil

        for folder in watched:
            shutil.rmtree(folder, ignore_errors=True)
    with open(out) as f:
        return json.load(f)


def report(nproc: int, results: dict, steps: int) -> list[str]:
    lines = []
    for workload, times in results.items():
        raw = times["raw"]
        row = [f"{nproc} proc {workload:>4}: raw {statistics.median(raw) / steps * 1e6:7.1f} us/step"]
        overheads = {}
        for name in ("hasten", "accelerate"):
            if name not in times:
                continue
            t = times[name]
            over = statistics.median((a - b) / steps * 1e6 for a, b in zip(t, raw))
            rate = statistics.median(b / a for a, b in zip(t, raw))  # step rate relative to raw
            overheads[name] = over
            row.append(f"{name} {statistics.median(t) / steps * 1e6:7.1f} us/step "
                       f"(+{over:6.1f} us, rate {rate:.3f}x raw)")
        if len(overheads) == 2 and overheads["accelerate"] > 0:
            row.append(f"hasten/accelerate overhead = {overheads['hasten'] / overheads['accelerate']:.2f}")
        lines.append(" | ".join(row))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workloads", default="null,mlp")
    parser.add_argument("--watch", action="store_true", help="heartbeat thread + torch flight recorder, as under "
                        "hasten launch")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for nproc in (int(p) for p in args.procs.split(",")):
        for line in report(nproc, launch(nproc, args), args.steps):
            print(line, flush=True)


if __name__ == "__main__":
    main()
