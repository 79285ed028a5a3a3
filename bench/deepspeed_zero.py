"""DeepSpeed under hasten: per-process memory of ZeRO-3 vs DDP, and step rate vs a hand-written loop.

    python bench/deepspeed_zero.py                       # 2 processes, 50.3M-parameter MLP, 3 rounds
    python bench/deepspeed_zero.py --rounds 5 --steps 8 --width 4096 --layers 3

Every round runs the three variants (rotating order between rounds), each in 2 fresh processes of
its own (gloo on CPU, NCCL with GPUs) so that no memory carries over, on a stack of ``layers``
Linear(width, width) layers (fp32, AdamW, batch 8 per process, gradient clipping 1.0):
  ddp    hasten, DDP (no deepspeed_plugin)
  zero3  hasten, DeepSpeedPlugin(zero_stage=3)
  raw    deepspeed.initialize by hand with the config hasten passes, engine.backward / engine.step
Measured on process 0: the step rate over ``steps`` timed steps after one warm-up step (fetching the
batch from each variant's dataloader included, between barriers), then, in one more step:
  state_bytes   parameter + gradient + optimizer-state bytes the process holds after the optimizer
                step (before zero_grad, so DDP's gradients still exist): the storages of the
                parameters (ZeRO-3: their partitions), gradients (ZeRO-3: the gradient partitions),
                the optimizer's own parameters (ZeRO-3: fp32 master partitions) and its state,
                each storage counted once (the FSDP2 figure of bench/sharded.py counts the same)
  other_bytes   every other live tensor storage (found through the garbage collector): DeepSpeed's
                reduce bucket, the batch, ... (tensors only C++ holds, such as DDP's reducer
                buckets when gradients are not views of them, show in the RSS alone)
  rss           resident memory after gc + malloc_trim, minus the resident memory before the model
                was built; peak_rss: the high-water mark minus the same baseline
Then the step rate that judges the issue's target: hasten's ZeRO-3 engine and a hand-written one
alive in the same 2 processes, one-step blocks in ABBA quartets (``--quartets``), median of the
per-quartet ratios (variants in separate processes one after another swing with the machine).
Reports medians over rounds, the ratio ZeRO-3 / DDP of each memory figure, the separate-process
step-rate ratio per round, and one PASS/FAIL line per target.
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

VARIANTS = ["ddp", "zero3", "raw"]


def _rss() -> int:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back so RSS shows what is live
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _storages(tensors) -> dict:
    """{storage address: bytes} of the given tensors, each storage once."""
    out = {}
    for t in tensors:
        if t is not None and hasattr(t, "untyped_storage") and not t.is_meta:
            s = t.untyped_storage()
            if s.data_ptr():
                out[s.data_ptr()] = s.nbytes()
    return out


def _live_storages() -> dict:
    import gc

    import torch

    return _storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _held(model, opt, engine) -> dict:
    """Storages of parameters, gradients, optimizer parameters and optimizer state."""
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad, getattr(p, "ds_tensor", None)]
    inner = getattr(opt, "optimizer", opt)
    for group in inner.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad]
    for key, state in inner.state.items():  # keys: the optimizer's parameters (ZeRO-3 detaches them between steps)
        tensors += [key, getattr(key, "grad", None)]
        tensors += [v for v in state.values() if hasattr(v, "dim") and v.dim() > 0]
    zero = getattr(engine, "optimizer", None) if engine is not None else None
    tensors.append(getattr(zero, "grad_partitions_flat_buffer", None))  # ZeRO-3's gradient partitions
    return _storages(tensors)


def _raw_engine(model, opt, batch: int, params: int, device):
    """``deepspeed.initialize`` by hand with the ZeRO-3 config hasten passes for this model."""
    import deepspeed
    import torch.distributed as dist

    from hasten.strategies.deepspeed_config import CPU_REDUCE_BUCKET

    config = {"train_micro_batch_size_per_gpu": batch, "train_batch_size": batch * dist.get_world_size(),
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
              "steps_per_print": 2 ** 62, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    if device.type == "cpu":
        config["zero_optimization"]["reduce_bucket_size"] = min(CPU_REDUCE_BUCKET, params)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    return engine


def same_processes(args) -> None:
    """Step rate with hasten's ZeRO-3 engine and a hand-written one alive in the same 2 processes:
    one-step blocks in ABBA quartets between barriers (as bench/sharded.py does for FSDP2), so both
    see the same machine state; the ratio per quartet is raw time / hasten time."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from hasten import Accelerator, DeepSpeedPlugin

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0))
    batch = 8

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    data = torch.utils.data.TensorDataset(torch.randn(batch * args.procs * (4 * args.quartets + 4), args.width))
    model, opt = build()
    params = sum(p.numel() for p in model.parameters())
    hasten_model, hasten_opt, hasten_loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=batch))
    raw_model, raw_opt = build()
    engine = _raw_engine(raw_model, raw_opt, batch, params, acc.device)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    raw_batches = iter(torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler))
    hasten_batches = iter(hasten_loader)

    def hasten_step():
        (x,) = next(hasten_batches)
        acc.backward(hasten_model(x).pow(2).mean())
        hasten_opt.step()
        hasten_opt.zero_grad()

    def raw_step():
        (x,) = next(raw_batches)
        loss = engine(x.to(acc.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    def timed(step) -> float:
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        return time.perf_counter() - start

    hasten_step()  # warm-up
    raw_step()
    ratios = []
    for q in range(args.quartets):
        order = [hasten_step, raw_step, raw_step, hasten_step] if q % 2 == 0 else [raw_step, hasten_step,
                                                                                   hasten_step, raw_step]
        spent = {hasten_step: 0.0, raw_step: 0.0}
        for step in order:
            spent[step] += timed(step)
        ratios.append(spent[raw_step] / spent[hasten_step])
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"ratios": ratios}, f)
    dist.barrier()
    dist.destroy_process_group()


def worker(args) -> None:
    if args.worker == "same":
        same_processes(args)
        return
    import torch
    import torch.distributed as dist
    from torch import nn

    import deepspeed  # every variant imports it, so the baseline holds the same libraries

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    variant = args.worker
    torch.manual_seed(0)
    batch = 8
    data = torch.utils.data.TensorDataset(torch.randn(batch * 2 * (args.steps + 3), args.width))
    if variant == "raw":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        from hasten import Accelerator, DeepSpeedPlugin

        plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0) if variant == "zero3" else None
        acc = Accelerator(deepspeed_plugin=plugin)
        device = acc.device
    base = _rss()
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant == "raw":
        engine = _raw_engine(model, opt, batch, params, device)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler)
        del model
        model = engine

        def step(x, measure=None):
            loss = engine(x.to(device)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            if measure:
                measure()
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=batch)
        model, opt, loader = acc.prepare(model, opt, loader)
        engine = model if variant == "zero3" else None

        def step(x, measure=None):
            loss = model(x).pow(2).mean()
            acc.backward(loss)
            opt.step()
            if measure:
                measure()
            opt.zero_grad()

    batches = iter(loader)
    step(*next(batches))  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(*next(batches))
    dist.barrier()
    rate = args.steps / (time.perf_counter() - start)
    found: dict = {}
    # One more step, measured after the optimizer step and before zero_grad: gradients, parameters and
    # optimizer state all exist then (DDP frees its .grad tensors in zero_grad; ZeRO keeps a buffer).
    step(*next(batches), measure=lambda: found.update(_held(engine.module if engine is not None else model, opt,
                                                             engine)))
    held = found
    rss = _rss() - base
    live = _live_storages()
    other = sum(n for ptr, n in live.items() if ptr not in held)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"variant": variant, "params": params, "state_bytes": sum(held.values()), "other_bytes": other,
                       "rss_bytes": rss, "peak_rss_bytes": _peak_rss() - base, "steps_per_s": rate}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(variant: str, args: argparse.Namespace, folder: str) -> dict:
    out = os.path.join(folder, f"{variant}.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.procs)))
    procs = []
    for rank in range(args.procs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.procs),
                   LOCAL_WORLD_SIZE=str(args.procs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=threads)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--width", str(args.width),
               "--layers", str(args.layers), "--steps", str(args.steps), "--quartets", str(args.quartets),
               "--out", out]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=None if args.verbose else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"variant {variant}: a worker failed with exit codes {codes} (rerun with --verbose)")
    with open(out) as f:
        return json.load(f)


def summary(results: dict) -> dict:
    mib = 2 ** 20

    def med(variant, key):
        return statistics.median(r[key] for r in results[variant])

    out: dict = {"parameters": results["ddp"][0]["params"], "rounds": len(results["ddp"])}
    for key in ("state_bytes", "other_bytes", "rss_bytes", "peak_rss_bytes"):
        out[key.replace("_bytes", "_mib")] = {v: round(med(v, key) / mib, 1) for v in results}
    out["steps_per_s"] = {v: round(med(v, "steps_per_s"), 4) for v in results}
    per_round = [z["steps_per_s"] / r["steps_per_s"] for z, r in zip(results["zero3"], results["raw"])]
    out["ratios"] = {
        "state_zero3_over_ddp": round(med("zero3", "state_bytes") / med("ddp", "state_bytes"), 3),
        "state_plus_other_zero3_over_ddp": round(
            (med("zero3", "state_bytes") + med("zero3", "other_bytes"))
            / (med("ddp", "state_bytes") + med("ddp", "other_bytes")), 3),
        "rss_zero3_over_ddp": round(med("zero3", "rss_bytes") / med("ddp", "rss_bytes"), 3),
        "peak_rss_zero3_over_ddp": round(med("zero3", "peak_rss_bytes") / med("ddp", "peak_rss_bytes"), 3),
        "step_rate_hasten_over_raw_per_round": [round(r, 3) for r in per_round],
        "step_rate_hasten_over_raw_median": round(statistics.median(per_round), 3),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quartets", type=int, default=6, help="ABBA quartets of the same-process step rate")
    parser.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    folder = tempfile.mkdtemp(prefix="hasten-bench-deepspeed-")
    results: dict = {v: [] for v in VARIANTS}
    try:
        for round_ in range(args.rounds):
            for variant in VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]:
                results[variant].append(run(variant, args, folder))
        same = run("same", args, folder)["ratios"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = summary(results)
    quartiles = statistics.quantiles(same, n=4) if len(same) > 1 else same * 3
    report["ratios"]["step_rate_same_processes_per_quartet"] = [round(r, 3) for r in same]
    report["ratios"]["step_rate_same_processes_median"] = round(statistics.median(same), 3)
    print(json.dumps(report, indent=1))
    memory = report["ratios"]["state_zero3_over_ddp"]
    rate = statistics.median(same)
    print(f"memory     {memory:.3f}x (target <= 0.55x) {'PASS' if memory <= 0.55 else 'FAIL'}  ZeRO-3 / DDP parameter + "
          "gradient + optimizer bytes per process")
    print(f"step rate  {rate:.3f}x (target >= 0.98x) {'PASS' if rate >= 0.98 else 'FAIL'}  hasten ZeRO-3 / hand-written "
          f"engine in the same processes, per ABBA quartet: median of {len(same)}, quartiles "
          f"{quartiles[0]:.3f}-{quartiles[2]:.3f}, range {min(same):.3f}-{max(same):.3f}; separate processes, per "
          f"round: {report['ratios']['step_rate_hasten_over_raw_per_round']}")


if __name__ == "__main__":
    main()
