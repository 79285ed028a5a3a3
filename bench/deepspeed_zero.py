"""DeepSpeed under hasten: per-process memory of ZeRO-3 vs DDP, and step rate vs a hand-written loop.

    python bench/deepspeed_zero.py                       # 2 processes, 50M-parameter MLP, CPU/gloo
    python bench/deepspeed_zero.py --steps 20 --width 4096 --layers 3

Each variant runs in fresh processes (memory must not carry over):
  ddp    hasten, DDP (no deepspeed_plugin)
  zero3  hasten, DeepSpeedPlugin(zero_stage=3)
  raw    deepspeed.initialize by hand (same config as hasten's), engine.backward / engine.step
Reported per variant: resident memory of rank 0 after training (after gc and malloc_trim, minus
the resident memory before the model was built) and the median step time after warm-up.
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


def worker(variant: str, width: int, layers: int, steps: int, out: str) -> None:
    import torch
    from torch import nn

    if variant != "raw":
        from hasten import Accelerator, DeepSpeedPlugin
    import deepspeed  # noqa: F401 - imported in every variant so the baseline holds the same libraries

    torch.manual_seed(0)
    batch = 8
    if variant == "raw":
        import torch.distributed as dist

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        dist.init_process_group("gloo")
    else:
        plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0) if variant == "zero3" else None
        acc = Accelerator(deepspeed_plugin=plugin)
    base = _rss()
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn(batch * 4 * (steps + 3), width))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    if variant == "raw":
        config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                  "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2 ** 62}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler)
        del model, opt
        times = []
        for i, (x,) in enumerate(loader):
            if i == steps + 3:
                break
            start = time.perf_counter()
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        rank = dist.get_rank()
    else:
        model, opt, loader = acc.prepare(model, opt, loader)
        times = []
        for i, (x,) in enumerate(loader):
            if i == steps + 3:
                break
            start = time.perf_counter()
            loss = model(x).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        rank = acc.process_index
    used = _rss() - base
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"variant": variant, "params": params, "rss_bytes": used,
                       "step_s": statistics.median(times[3:])}, f)


def run(variant: str, args: argparse.Namespace) -> dict:
    out = tempfile.mktemp(suffix=".json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.procs)))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.procs}", f"--master_port={port}",
           __file__, "--worker", variant, "--width", str(args.width), "--layers", str(args.layers),
           "--steps", str(args.steps), "--out", out]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.layers, args.steps, args.out)
        return
    results: dict[str, list] = {"ddp": [], "zero3": [], "raw": []}
    for _ in range(args.rounds):
        for variant in results:
            results[variant].append(run(variant, args))
    summary = {v: {"params": r[0]["params"], "rss_mib": statistics.median(x["rss_bytes"] for x in r) / 2 ** 20,
                   "step_ms": statistics.median(x["step_s"] for x in r) * 1e3} for v, r in results.items()}
    summary["zero3_over_ddp_memory"] = summary["zero3"]["rss_mib"] / summary["ddp"]["rss_mib"]
    summary["hasten_over_raw_step_rate"] = summary["raw"]["step_ms"] / summary["zero3"]["step_ms"]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
