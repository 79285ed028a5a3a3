"""Sharded training on 2 processes: memory, step rate and checkpoint speed of FSDP2 through hasten.

    python bench/sharded.py                     # 50.3M-parameter model, 2 gloo processes (~3-4 min on 2 CPU cores)
    python bench/sharded.py --quartets 12 --saves 6 --loads 10
    python bench/sharded.py --width 256 --layers 4 --quartets 4   # a quick check that it runs

The script starts 2 processes of itself (torchrun's variables, gloo on CPU, NCCL with GPUs). The
model is a stack of ``layers`` Linear(width, width) layers, fp32, Adam, ``batch`` rows per process,
read from a DataLoader (hasten: a prepared one; hand-written: ``DistributedSampler``, same global
batches), loss ``model(x).pow(2).mean()``, ``zero_grad(set_to_none=True)``. Three phases:

1. **DDP through hasten** (``Accelerator()``): per-process parameter + gradient + Adam bytes (the
   local tensors after a step, with the gradients of a backward present) and a few timed steps;
   then freed.
2. **FSDP2 through hasten vs a hand-written FSDP2 loop**, both models alive in the same processes:
   hasten's ``FullyShardedDataParallelPlugin(fsdp_version=2)`` with SIZE_BASED_WRAP (one FSDP group
   per Linear, then the root), against ``fully_shard`` on each Linear and on the root with the same
   defaults (``reshard_after_forward=True``, no mixed precision). Blocks of ``block_steps`` steps
   alternate in ABBA quartets (hasten, raw, raw, hasten, then raw, hasten, hasten, raw, ...), each
   block between two barriers, so machine noise and slow drift hit both alike; the figure is the
   median over quartets of (raw time / hasten time), with its spread. The Python function calls
   of one step of each loop are counted too (cProfile: counted, not timed, so load barely moves
   them), and the two models' parameters are compared at the end (same data, same steps: equal up
   to rounding).
3. **Sharded checkpoint of hasten's FSDP2 model**: ``save_state``/``load_state`` (DCP shards
   fsynced, RNG and data-position files, manifest, atomic rename) against ``dcp.save``/``dcp.load``
   of the same model and optimizer with ``FileSystemWriter(sync_files=True)`` (the same fsync of
   the shard files), in ABBA order (hasten, raw, raw, hasten, ...); the folder each save writes
   to is removed (untimed) before it. Figure: median over pairs of (raw time / hasten time).

Process 0 prints a table, the JSON figures and one line per target of the issue (PASS/FAIL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TARGETS = {"memory": 0.55, "step_rate": 0.98, "save": 0.9, "load": 0.9}


def _model(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _dataset(args):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    # One block of steps is one pass over the data (both loaders run whole epochs, no partial iterators).
    return TensorDataset(torch.randn(2 * args.batch * args.block_steps, args.width, generator=g))


def _local_bytes(model, opt, backward, width: int) -> int:
    """Parameter + gradient + optimizer-state bytes this process holds, with the gradients of one backward
    present (then zeroed again: the models stay in step with each other)."""
    import torch

    backward(model(torch.ones(1, width)).pow(2).mean())

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in opt.state.values():
        for v in state.values():
            if hasattr(v, "numel") and v.dim() > 0:
                total += local(v).numel() * local(v).element_size()
    opt.zero_grad(set_to_none=True)
    return total


def _timed(run, barrier) -> float:
    barrier()
    start = time.perf_counter()
    run()
    barrier()
    return time.perf_counter() - start


def _reset_hasten() -> None:
    from hasten.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def _hasten_loop(args, plugin):
    """A model, optimizer and dataloader prepared by an ``Accelerator``; returns (run one epoch, acc, model, opt)."""
    import torch
    from torch.utils.data import DataLoader

    from hasten import Accelerator

    _reset_hasten()
    acc = Accelerator(fsdp_plugin=plugin)
    model = _model(args.width, args.layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt, loader = acc.prepare(model, opt, DataLoader(_dataset(args), batch_size=args.batch))

    def epoch():
        for (x,) in loader:
            acc.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad(set_to_none=True)

    epoch.bytes = lambda: _local_bytes(model, opt.optimizer, acc.backward, args.width)
    return epoch, acc, model, opt


def _raw_loop(args):
    """The hand-written FSDP2 loop; returns (run one epoch, model, optimizer)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    model = _model(args.width, args.layers)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data = _dataset(args)
    # No shuffling: process r gets rows r, r+2, ... of each global batch, hasten's loader whole batches
    # of it; the global batch of every step is the same rows, so the two models stay equal (rounding).
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    epochs = [0]

    def epoch():
        sampler.set_epoch(epochs[0])
        epochs[0] += 1
        for (x,) in loader:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    epoch.bytes = lambda: _local_bytes(model, opt, lambda loss: loss.backward(), args.width)
    return epoch, model, opt


def _ddp_phase(args, barrier) -> dict:
    import gc

    epoch, acc, model, opt = _hasten_loop(args, None)
    epoch()  # warm-up; creates the Adam state
    out = {"bytes": epoch.bytes()}
    out["block_s"] = [_timed(epoch, barrier) for _ in range(args.ddp_blocks)]
    acc.free_memory()
    del epoch, acc, model, opt
    gc.collect()
    return out


def _python_calls(run) -> dict:
    """Python function calls of one epoch (and those in hasten's own code), counted by cProfile."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(v[1] for v in stats.values())
    ours = sum(v[1] for k, v in stats.items() if f"{os.sep}hasten{os.sep}" in k[0])
    return {"all": total, "hasten": ours}


def _max_difference(a, b) -> float:
    diff = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        full_p = p.full_tensor() if hasattr(p, "full_tensor") else p
        full_q = q.full_tensor() if hasattr(q, "full_tensor") else q
        diff = max(diff, float((full_p.detach() - full_q.detach()).abs().max()))
    return diff


def _fsdp2_phase(args, barrier, folder: str) -> dict:
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP",
                                            min_num_params=args.width * args.width)
    ours, acc, model, opt = _hasten_loop(args, plugin)
    raw, raw_model, raw_opt = _raw_loop(args)
    loops = {"hasten": ours, "raw": raw}
    for run in loops.values():  # warm-up; creates the Adam state
        run()
    out: dict = {"bytes": {name: run.bytes() for name, run in loops.items()}}
    out["calls_per_step"] = {name: {k: v / args.block_steps for k, v in _python_calls(run).items()}
                             for name, run in loops.items()}
    times: dict = {"hasten": [], "raw": []}
    for q in range(args.quartets):
        first, second = ("hasten", "raw") if q % 2 == 0 else ("raw", "hasten")
        for name in (first, second, second, first):
            times[name].append(_timed(loops[name], barrier))
    out["block_s"] = times
    out["steps_per_variant"] = 2 + 2 * args.quartets  # warm-up, counted call, blocks
    out["max_param_difference"] = _max_difference(model, raw_model)
    out["checkpoint_s"] = _checkpoints(acc, model, opt.optimizer, args, folder, barrier)
    return out


def _checkpoints(acc, model, opt, args, folder: str, barrier) -> dict:
    """One model, two checkpoint paths, in alternating order: hasten's save_state/load_state and raw
    dcp.save/dcp.load (``FileSystemWriter(sync_files=True)``: the shard files fsynced, as hasten does)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    paths = {"hasten": os.path.join(folder, "hasten"), "dcp": os.path.join(folder, "dcp")}

    def raw_save():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd},
                 storage_writer=dcp.FileSystemWriter(paths["dcp"], sync_files=True, single_file_per_rank=True))

    def raw_load():
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=dcp.FileSystemReader(paths["dcp"]))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    jobs = {"hasten_save": lambda: acc.save_state(paths["hasten"]), "dcp_save": raw_save,
            "hasten_load": lambda: acc.load_state(paths["hasten"]), "dcp_load": raw_load}
    times: dict = {k: [] for k in jobs}
    for kind, repeats in (("save", args.saves), ("load", args.loads)):
        for i in range(repeats):
            order = ("hasten", "dcp") if i % 2 == 0 else ("dcp", "hasten")
            for who in order:
                if kind == "save":  # a fresh folder for every save (no swap, no background deletion)
                    if dist.get_rank() == 0:
                        shutil.rmtree(paths[who], ignore_errors=True)
                    barrier()
                times[f"{who}_{kind}"].append(_timed(jobs[f"{who}_{kind}"], barrier))
    if dist.get_rank() == 0:
        for path in paths.values():
            shutil.rmtree(path, ignore_errors=True)
    barrier()
    return times


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from hasten.state import PartialState

    state = PartialState()
    started = time.perf_counter()
    results = {"ddp": _ddp_phase(args, dist.barrier)}
    results["fsdp2"] = _fsdp2_phase(args, dist.barrier, args.dir)
    results["worker_s"] = time.perf_counter() - started
    if state.is_main_process:
        with open(args.out, "w") as f:
            json.dump(results, f)
    state.destroy_process_group()


def _spread(values: list) -> dict:
    values = sorted(values)
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "min": values[0], "max": values[-1],
            "n": len(values)}


def _summary(results: dict, args) -> dict:
    fsdp = results["fsdp2"]
    blocks = fsdp["block_s"]
    # Quartet q holds blocks 2q and 2q+1 of each variant.
    per_quartet = [(blocks["raw"][2 * q] + blocks["raw"][2 * q + 1]) / (blocks["hasten"][2 * q] + blocks["hasten"][2 * q + 1])
                   for q in range(args.quartets)]
    ckpt = fsdp["checkpoint_s"]
    pairs = {kind: [r / h for h, r in zip(ckpt[f"hasten_{kind}"], ckpt[f"dcp_{kind}"])] for kind in ("save", "load")}
    steps = args.block_steps
    return {
        "parameters": args.layers * (args.width * args.width + args.width),
        "bytes_per_process": {"ddp": results["ddp"]["bytes"], **fsdp["bytes"]},
        "steps_per_s": {"ddp": steps / statistics.median(results["ddp"]["block_s"]),
                        "hasten_fsdp2": steps / statistics.median(blocks["hasten"]),
                        "raw_fsdp2": steps / statistics.median(blocks["raw"])},
        "python_calls_per_step": fsdp["calls_per_step"],
        "max_param_difference": fsdp["max_param_difference"],
        "checkpoint_s": {k: statistics.median(v) for k, v in ckpt.items()},
        "ratios": {
            "memory_fsdp2_over_ddp": fsdp["bytes"]["hasten"] / results["ddp"]["bytes"],
            "step_rate_hasten_over_raw": _spread(per_quartet),
            "step_rate_total_time": sum(blocks["raw"]) / sum(blocks["hasten"]),
            # The least disturbed block of each: a low-noise view on a loaded machine.
            "step_rate_fastest_blocks": min(blocks["raw"]) / min(blocks["hasten"]),
            "save_speed_hasten_over_dcp": _spread(pairs["save"]),
            "load_speed_hasten_over_dcp": _spread(pairs["load"]),
            **{f"{kind}_speed_fastest": min(ckpt[f"dcp_{kind}"]) / min(ckpt[f"hasten_{kind}"]) for kind in ("save", "load")},
        },
        "worker_s": results["worker_s"],
    }


def _verdicts(s: dict) -> list[str]:
    r = s["ratios"]

    def line(name, value, target, above, detail):
        ok = value >= target if above else value <= target
        sign = ">=" if above else "<="
        return f"{name:<10} {value:.3f}x (target {sign} {target}x) {'PASS' if ok else 'FAIL'}  {detail}"

    def spread(x):
        return f"median of {x['n']}, quartiles {x['q1']:.3f}-{x['q3']:.3f}, range {x['min']:.3f}-{x['max']:.3f}"

    step = r["step_rate_hasten_over_raw"]
    return [
        line("memory", r["memory_fsdp2_over_ddp"], TARGETS["memory"], False,
             "FSDP2 (hasten) / DDP parameter + gradient + Adam bytes per process"),
        line("step rate", step["median"], TARGETS["step_rate"], True,
             f"hasten FSDP2 / hand-written fully_shard, per ABBA quartet: {spread(step)}; "
             f"total time ratio {r['step_rate_total_time']:.3f}, fastest blocks {r['step_rate_fastest_blocks']:.3f}"),
        line("save", r["save_speed_hasten_over_dcp"]["median"], TARGETS["save"], True,
             f"save_state / dcp.save speed, per pair: {spread(r['save_speed_hasten_over_dcp'])}; "
             f"fastest {r['save_speed_fastest']:.3f}"),
        line("load", r["load_speed_hasten_over_dcp"]["median"], TARGETS["load"], True,
             f"load_state / dcp.load speed, per pair: {spread(r['load_speed_hasten_over_dcp'])}; "
             f"fastest {r['load_speed_fastest']:.3f}"),
    ]


def _table(s: dict) -> list[str]:
    mb = {k: v / 1e6 for k, v in s["bytes_per_process"].items()}
    rate = s["steps_per_s"]
    calls = s["python_calls_per_step"]
    ck = s["checkpoint_s"]
    return [
        f"model: {s['parameters'] / 1e6:.1f}M parameters; 2 processes",
        f"per process              DDP (hasten)   FSDP2 (hasten)   hand-written fully_shard",
        f"param+grad+Adam MB       {mb['ddp']:12.1f}   {mb['hasten']:14.1f}   {mb['raw']:12.1f}",
        f"steps/s (median block)   {rate['ddp']:12.3f}   {rate['hasten_fsdp2']:14.3f}   {rate['raw_fsdp2']:12.3f}",
        f"Python calls per step                   {calls['hasten']['all']:14.0f}   {calls['raw']['all']:12.0f}"
        f"   ({calls['hasten']['hasten']:.0f} in hasten's code)",
        f"max |hasten - hand-written| parameter after the run: {s['max_param_difference']:.2e}",
        f"checkpoint (median s)    save: hasten {ck['hasten_save']:.3f}, dcp {ck['dcp_save']:.3f}   "
        f"load: hasten {ck['hasten_load']:.3f}, dcp {ck['dcp_load']:.3f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="rows per process and step")
    parser.add_argument("--block-steps", type=int, default=1, help="steps per timed block")
    parser.add_argument("--quartets", type=int, default=10, help="ABBA quartets of blocks (hasten vs hand-written)")
    parser.add_argument("--ddp-blocks", type=int, default=3, help="timed DDP blocks (for the table only)")
    parser.add_argument("--saves", type=int, default=10, help="saves of each kind (alternating order)")
    parser.add_argument("--loads", type=int, default=12, help="loads of each kind (alternating order)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    tmp = tempfile.mkdtemp(prefix="hasten-bench-sharded-")
    args.dir = args.dir or tmp
    args.out = os.path.join(tmp, "results.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker",)]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", *forwarded], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")
    with open(args.out) as f:
        results = json.load(f)
    summary = _summary(results, args)
    print(json.dumps(summary, indent=1))
    print("\n".join(_table(summary)))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"load average at the end: {load:.1f} on {os.cpu_count()} cores")
    print("\n".join(_verdicts(summary)))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
