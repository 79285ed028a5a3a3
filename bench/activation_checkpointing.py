"""Activation memory kept for backward, and step time, per activation-checkpointing mode.

    python bench/activation_checkpointing.py                 # the test's tiny Llama and a ~110M Llama
    python bench/activation_checkpointing.py --model 110m --seq 1024 --batch 2 --steps 3
    python bench/activation_checkpointing.py --quick         # the tiny model, one step: a smoke test

Each mode prepares a fresh model with ``Accelerator(kwargs_handlers=[ActivationCheckpointingKwargs(...)])``
(one process) and runs one measured forward (``hasten.activation_checkpointing.measure_saved_bytes``):
"alive" is every byte the forward created and left alive for backward (outputs included), "autograd"
what autograd's saved-tensor hooks saw (a selective checkpoint keeps its matmul outputs outside them).
Then ``--steps`` timed steps (forward, backward, AdamW) per mode in each of ``--rounds`` interleaved
rounds; on CUDA also the peak memory of a step. It prints one markdown table per model, the command
and the load average. Timings on a shared CPU machine say little (rerun on an idle one); the byte
counts do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Optional

MODES = {"none": None, "full": {"mode": "full"}, "selective": {"mode": "selective"},
         "every_2": {"mode": "every_k", "every": 2}, "full+offload": {"mode": "full", "offload": True}}
MODELS = {  # name: (layers, hidden, intermediate, heads, kv heads, vocab)
    "tiny": (4, 64, 176, 4, 2, 128),
    "110m": (12, 768, 2048, 12, 12, 16000),
}


def build(name: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter, heads, kv, vocab = MODELS[name]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg)


def prepare(name: str, mode: str, batch: int, seq: int) -> dict:
    """A fresh model prepared with ``mode``, its optimizer and a fixed batch; the bytes its first
    forward keeps for backward (``measure_saved_bytes``), after which one warm-up step runs."""
    import torch

    from hasten import Accelerator
    from hasten.activation_checkpointing import measure_saved_bytes
    from hasten.state import AcceleratorState, GradientState
    from hasten.utils import ActivationCheckpointingKwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    setting = MODES[mode]
    acc = Accelerator(kwargs_handlers=[ActivationCheckpointingKwargs(**setting)] if setting else [])
    model = build(name)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    vocab = MODELS[name][5]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(acc.device)
    with measure_saved_bytes(model) as kept:
        loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return {"acc": acc, "model": model, "opt": opt, "ids": ids, "params": params, "alive": kept.alive,
            "autograd": kept.autograd}


def timed_steps(run: dict, steps: int) -> tuple[list[float], Optional[int]]:
    """``steps`` timed steps (forward, backward, AdamW); on CUDA also the peak memory of a step."""
    import torch

    acc, model, opt, ids = run["acc"], run["model"], run["opt"], run["ids"]
    cuda = acc.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, (torch.cuda.max_memory_allocated() if cuda else None)


def measure(name: str, batch: int, seq: int, steps: int, rounds: int) -> list[dict]:
    """Every mode, interleaved: each round prepares each mode afresh (the order reversed every other
    round) and times ``steps`` steps of it, so the machine's load falls on all modes alike."""
    rows = {mode: {"model": name, "mode": mode, "batch": batch, "seq": seq, "times": [], "peak": None} for mode in MODES}
    for r in range(max(rounds, 1)):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
            run = prepare(name, mode, batch, seq)
            row = rows[mode]
            row.update(params=run["params"], alive=run["alive"], autograd=run["autograd"], device=str(run["acc"].device))
            times, peak = timed_steps(run, steps)
            row["times"].append(statistics.median(times) if times else None)
            row["peak"] = max(row["peak"] or 0, peak or 0) or None
            del run
    for row in rows.values():
        times = [t for t in row["times"] if t is not None]
        row["step_s"] = statistics.median(times) if times else None
    base = rows["none"]["times"]
    for row in rows.values():  # the ratio to "none" within each round, then its median and range
        ratios = [t / b for t, b in zip(row["times"], base) if t and b]
        row["ratio"] = statistics.median(ratios) if ratios else None
        row["ratio_range"] = (min(ratios), max(ratios)) if ratios else None
    return list(rows.values())


def print_table(rows: list[dict]) -> None:
    first = rows[0]
    print(f"\n{first['model']}: {first['params']:,} parameters, batch {first['batch']} x seq {first['seq']}, "
          f"device {first['device']}")
    print("| mode | kept for backward (alive) | vs none | autograd saved | step s (median) | step vs none (range) |")
    print("|---|---|---|---|---|---|")
    base = first["alive"]
    for row in rows:
        step = f"{row['step_s']:.3f}" if row["step_s"] else "-"
        ratio = (f"{row['ratio']:.2f}x ({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f})"
                 if row["ratio"] else "-")
        peak = f", peak {row['peak'] / 2**20:.0f} MiB" if row["peak"] else ""
        print(f"| {row['mode']} | {row['alive'] / 1e6:.1f} MB | {row['alive'] / base:.2f} | "
              f"{row['autograd'] / 1e6:.1f} MB | {step}{peak} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--batch", type=int, default=None, help="default: 2 (tiny), 1 (110m)")
    parser.add_argument("--seq", type=int, default=None, help="default: 32 (tiny), 512 (110m)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode and round (0: bytes only)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the modes")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 1 round of 1 step (a smoke test)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.rounds = "tiny", 1, 1
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    rows = []
    for name in (MODELS if args.model == "both" else [args.model]):
        batch = args.batch or (2 if name == "tiny" else 1)
        seq = args.seq or (32 if name == "tiny" else 512)
        table = measure(name, batch, seq, args.steps, args.rounds)
        print_table(table)
        rows += table
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
