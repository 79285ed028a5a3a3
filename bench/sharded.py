"""Sharded training on 2 processes: memory, step rate and checkpoint speed of FSDP2 through hasten.

    python bench/sharded.py                   # 50.3M-parameter model, 2 gloo processes, 3 rounds
    python bench/sharded.py --rounds 5 --width 2048 --layers 12 --steps 4

The script starts 2 processes of itself (torchrun's variables, gloo on CPU, NCCL with GPUs) and
runs, interleaved in every round (rotating order), on a stack of ``layers`` Linear(width, width)
layers (fp32, Adam):
  * DDP through hasten (``Accelerator()``),
  * FSDP2 through hasten (``FullyShardedDataParallelPlugin(fsdp_version=2)``, SIZE_BASED_WRAP: one
    FSDP group per Linear),
  * a hand-written FSDP2 loop: ``fully_shard`` on each Linear and on the root, plain optimizer.
For each it measures per-process parameter + gradient + optimizer-state bytes (the local tensors
each process holds after a step), the step rate over ``steps`` steps (after one warm-up step), and
on hasten's FSDP2 model the time of a sharded checkpoint, the two paths interleaved (one save
each, then ``loads`` loads each, alternating which goes first): ``save_state``/``load_state``
(DCP shards fsynced, manifest, atomic rename) against ``dcp.save``/``dcp.load`` with
``FileSystemWriter(sync_files=True)`` (the same fsync of the shard files). Reports medians over
rounds and the ratios the issue asks for, on process 0, as JSON and a table.
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


def _model(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _local_bytes(model, opt) -> int:
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
    return total


def _time_steps(step, steps: int, barrier) -> float:
    step()  # warm-up
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    return steps / (time.perf_counter() - start)


def _variant(name: str, args, folder: str) -> dict:
    import torch
    import torch.distributed as dist

    from hasten import Accelerator
    from hasten.state import AcceleratorState, GradientState
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    AcceleratorState._reset_state()
    GradientState._reset_state()
    model = _model(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    out: dict = {}
    if name == "raw_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    else:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP",
                                                min_num_params=args.width * args.width) if name == "fsdp2" else None
        acc = Accelerator(fsdp_plugin=plugin)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)

        def step():
            acc.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
    out["steps_per_s"] = _time_steps(step, args.steps, dist.barrier)
    out["bytes"] = _local_bytes(model, getattr(opt, "optimizer", opt))
    if name == "fsdp2":
        out.update(_checkpoints(acc, model, opt.optimizer, args, folder))
    return out


_ROUNDS: list = []


def _checkpoints(acc, model, opt, args, folder: str) -> dict:
    """One model, two checkpoint paths, interleaved: hasten's save_state/load_state and raw dcp.save/dcp.load
    (``FileSystemWriter(sync_files=True)``: the shard files fsynced, as hasten does)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ours, raw = os.path.join(folder, "hasten"), os.path.join(folder, "dcp")

    def raw_save():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(raw, sync_files=True,
                                                                                   single_file_per_rank=True))

    def raw_load():
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=dcp.FileSystemReader(raw))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    jobs = {"hasten_save": lambda: acc.save_state(ours), "dcp_save": raw_save,
            "hasten_load": lambda: acc.load_state(ours), "dcp_load": raw_load}
    times: dict = {k: [] for k in jobs}
    flip = _ROUNDS.append(None) or len(_ROUNDS) % 2  # alternate who goes first between rounds (same on every rank)
    for kind, repeats in (("save", 1), ("load", args.loads)):
        for i in range(repeats):
            names = [f"hasten_{kind}", f"dcp_{kind}"]
            if (i + int(flip)) % 2:
                names.reverse()
            for name in names:
                if kind == "save" and dist.get_rank() == 0:
                    shutil.rmtree(ours if name.startswith("hasten") else raw, ignore_errors=True)
                dist.barrier()
                start = time.perf_counter()
                jobs[name]()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        shutil.rmtree(ours, ignore_errors=True)
        shutil.rmtree(raw, ignore_errors=True)
    dist.barrier()
    return {k: statistics.median(v) for k, v in times.items()}


def _worker(args) -> None:
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from hasten.state import PartialState

    state = PartialState()
    names = ["ddp", "fsdp2", "raw_fsdp2"]
    results: dict = {n: [] for n in names}
    for round_ in range(args.rounds):
        order = names[round_ % 3:] + names[:round_ % 3]
        for name in order:
            results[name].append(_variant(name, args, args.dir))
    if state.is_main_process:
        with open(args.out, "w") as f:
            json.dump(results, f)
    state.destroy_process_group()


def _summary(results: dict, args) -> dict:
    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    params = args.layers * (args.width * args.width + args.width)
    rows = {
        "parameters": params,
        "bytes_per_process": {n: med(n, "bytes") for n in results},
        "steps_per_s": {n: med(n, "steps_per_s") for n in results},
        "checkpoint_s": {k: med("fsdp2", k) for k in ("hasten_save", "dcp_save", "hasten_load", "dcp_load")},
    }
    per_round = [(f["steps_per_s"] / r["steps_per_s"]) for f, r in zip(results["fsdp2"], results["raw_fsdp2"])]
    rows["ratios"] = {
        "memory_fsdp2_over_ddp": rows["bytes_per_process"]["fsdp2"] / rows["bytes_per_process"]["ddp"],
        "step_rate_hasten_over_raw_fsdp2": rows["steps_per_s"]["fsdp2"] / rows["steps_per_s"]["raw_fsdp2"],
        "step_rate_ratio_per_round": [round(v, 3) for v in per_round],
        "save_speed_hasten_over_dcp": rows["checkpoint_s"]["dcp_save"] / rows["checkpoint_s"]["hasten_save"],
        "load_speed_hasten_over_dcp": rows["checkpoint_s"]["dcp_load"] / rows["checkpoint_s"]["hasten_load"],
    }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--loads", type=int, default=3, help="loads per round (median)")
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
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rounds", str(args.rounds), "--width",
               str(args.width), "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
               "--loads", str(args.loads),
               "--dir", args.dir, "--out", args.out]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")
    with open(args.out) as f:
        results = json.load(f)
    summary = _summary(results, args)
    summary["raw"] = results
    print(json.dumps({k: v for k, v in summary.items() if k != "raw"}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
