"""fp8 (torchao) against bf16 and fp32: accuracy everywhere, speed and memory where it means something.

    python bench/fp8.py                      # CPU: correctness figures (a small MLP)
    python bench/fp8.py --dim 4096 --steps 50 --recipe rowwise   # on an fp8 GPU (H100 class)

Correctness, on any device: the same model, data and seed trained with hasten under
mixed_precision "no", "bf16" and "fp8"; reported are the final loss of each run, the largest
per-step loss gap of bf16 and fp8 against fp32, and the relative error of one converted layer's
output (float8 vs fp32 on the same weights and input), which shows the quantisation is real.
Speed and memory (steps/s after warm-up, peak allocated memory) are printed too; on CPU they only
show that float8 is emulated there (torch._scaled_mm on CPU is slow) and are not a fp8 benchmark.
"""

from __future__ import annotations

import argparse
import json
import time


def build(dim: int, depth: int, seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(dim // 2, dim), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(dim, dim), nn.ReLU()]
    layers.append(nn.Linear(dim, 16))
    return nn.Sequential(*layers)


def run(precision: str, args: argparse.Namespace) -> dict:
    import torch

    from hasten import Accelerator
    from hasten.state import AcceleratorState, GradientState
    from hasten.utils import AORecipeKwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    handlers = [AORecipeKwargs(config=args.recipe)] if precision == "fp8" else []
    acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers, cpu=args.cpu)
    model = build(args.dim, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps, args.batch, args.dim // 2, generator=g)
    y = torch.tanh(x[..., :16] * 2)
    losses, start = [], None
    if acc.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        if step == args.warmup:
            if acc.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        xb, yb = x[step].to(acc.device), y[step].to(acc.device)
        loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if acc.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {"precision": precision, "final_loss": losses[-1], "losses": losses,
              "steps_per_s": (args.steps - args.warmup) / elapsed}
    if acc.device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if precision == "fp8":
        result["layer_rel_error"] = layer_error(acc.unwrap_model(model), acc.device)
    return result


def layer_error(model, device) -> float:
    """Relative error of the first converted layer's output against fp32 on the same weights."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    layer = next(m for m in model.modules() if isinstance(m, Float8Linear))
    plain = torch.nn.Linear(layer.in_features, layer.out_features).to(device)
    plain.load_state_dict(layer.state_dict())
    h = torch.randn(256, layer.in_features, device=device)
    with torch.no_grad():
        ref = plain(h)
        out = layer(h).float()
    return ((out - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2, help="hidden Linear(dim, dim) layers (converted)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    runs = {p: run(p, args) for p in ("no", "bf16", "fp8")}
    ref = runs["no"]["losses"]
    for name in ("bf16", "fp8"):
        gaps = [abs(a - b) / b for a, b in zip(runs[name]["losses"], ref)]
        runs[name]["max_loss_gap_vs_fp32"] = max(gaps)
    fp8_vs_bf16 = [abs(a - b) / b for a, b in zip(runs["fp8"]["losses"], runs["bf16"]["losses"])]
    summary = {
        "config": vars(args),
        "runs": {k: {m: v for m, v in r.items() if m != "losses"} for k, r in runs.items()},
        "max_loss_gap_fp8_vs_bf16": max(fp8_vs_bf16),
    }
    if args.json:
        print(json.dumps(summary))
        return
    print(f"model: {args.depth + 2} Linear layers, dim {args.dim}, batch {args.batch}, {args.steps} AdamW steps, "
          f"recipe {args.recipe}")
    for name, r in summary["runs"].items():
        extra = f"  peak {r['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in r else ""
        gap = f"  max loss gap vs fp32 {r['max_loss_gap_vs_fp32']:.1%}" if "max_loss_gap_vs_fp32" in r else ""
        err = f"  layer output rel. error {r['layer_rel_error']:.2%}" if "layer_rel_error" in r else ""
        print(f"  {name:>4}: final loss {r['final_loss']:.4f}  {r['steps_per_s']:.1f} steps/s{extra}{gap}{err}")
    print(f"  max per-step loss gap fp8 vs bf16: {summary['max_loss_gap_fp8_vs_bf16']:.1%}")


if __name__ == "__main__":
    main()
