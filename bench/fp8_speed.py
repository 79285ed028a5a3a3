"""Does fp8 pay? Step time of a transformer-like model: bf16 and fp8 (torchao), eager and compiled,
through hasten and by hand.

    python bench/fp8_speed.py                     # on an fp8 GPU (H100 class): a ~0.75B model
    python bench/fp8_speed.py --small --cpu       # anywhere: a smoke run (CPU float8 is emulated)

Variants (each in its own process, so compile caches and memory do not leak between them):

    bf16            hasten, mixed_precision="bf16", eager
    bf16+compile    hasten, bf16, dynamo_backend="inductor"
    fp8 eager       hasten, fp8, AORecipeKwargs(auto_compile=False)
    fp8 default     hasten, fp8, default settings (on CUDA: the float8 layers compiled)
    fp8 regional    hasten, fp8, TorchDynamoPlugin(use_regional_compilation=True): the blocks compiled
    fp8+compile     hasten, fp8, dynamo_backend="inductor"
    raw fp8+compile torchao by hand: convert_to_float8_training (same layers), torch.compile, bf16 autocast

Goals (#17 item 5, on an H100): "fp8 default" at least as fast as "bf16"; "fp8+compile" within 2%
of "raw fp8+compile". Each goal prints a PASS/FAIL line. Timings are medians of the steps after
warm-up (the first steps compile); on a shared or CPU machine they say little.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("bf16", "bf16+compile", "fp8 eager", "fp8 default", "fp8 regional", "fp8+compile", "raw fp8+compile")


def build(args: argparse.Namespace):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
            return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.dim)
            self.blocks = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.depth))
            self.norm = nn.LayerNorm(args.dim)
            self.head = nn.Linear(args.dim, args.vocab, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Model()


def prepared(variant: str, args: argparse.Namespace):
    """(model, optimizer, autocast context factory, device) for one variant."""
    import contextlib

    import torch

    from hasten import Accelerator
    from hasten.fp8 import default_module_filter
    from hasten.utils import AORecipeKwargs, TorchDynamoPlugin

    model = build(args)
    if variant == "raw fp8+compile":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
        model = model.to(device)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(args.recipe),
                                   module_filter_fn=default_module_filter(model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return torch.compile(model), optimizer, lambda: torch.autocast(device.type, dtype=torch.bfloat16), device
    precision = "bf16" if variant.startswith("bf16") else "fp8"
    handlers = []
    if precision == "fp8":
        handlers = [AORecipeKwargs(config=args.recipe, auto_compile=False if variant == "fp8 eager" else None)]
    backend = "inductor" if variant.endswith("+compile") else None
    plugin = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True) if variant == "fp8 regional" else None
    acc = Accelerator(mixed_precision=precision, cpu=args.cpu, dynamo_backend=backend, dynamo_plugin=plugin,
                      kwargs_handlers=handlers)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return model, optimizer, contextlib.nullcontext, acc.device


def time_variant(variant: str, args: argparse.Namespace) -> dict:
    import torch

    model, optimizer, autocast, device = prepared(variant, args)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        with autocast():
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "ms_per_step": 1000 * statistics.median(times), "loss": loss.item(),
            "params": params, "device": str(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=14)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--small", action="store_true", help="dim 256, depth 2, seq 64, batch 4, 4 steps: a smoke run")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the worker: time this variant, print JSON
    args = parser.parse_args()
    if args.small:
        args.dim, args.depth, args.heads, args.vocab, args.seq, args.batch, args.steps, args.warmup = \
            256, 2, 4, 512, 64, 4, 4, 2
    if args.one:
        print(json.dumps(time_variant(args.one, args)))
        return
    results = {}
    for variant in args.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--one", variant]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{variant:>16}: failed\n{done.stderr[-2000:]}")
            continue
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[variant]
        print(f"{variant:>16}: {r['ms_per_step']:8.1f} ms/step  loss {r['loss']:.3f}  ({r['params'] / 1e6:.1f}M params, {r['device']})",
              flush=True)
    goals = (("fp8 default", "bf16", 1.0, "fp8 with default settings at least as fast as bf16 eager"),
             ("fp8+compile", "raw fp8+compile", 1.02, "hasten fp8+compile within 2% of raw fp8+compile"))
    for mine, theirs, limit, what in goals:
        if mine in results and theirs in results:
            ratio = results[mine]["ms_per_step"] / results[theirs]["ms_per_step"]
            print(f"{'PASS' if ratio <= limit else 'FAIL'}: {what}: {ratio:.3f}x (limit {limit:.2f}x)")


if __name__ == "__main__":
    main()
