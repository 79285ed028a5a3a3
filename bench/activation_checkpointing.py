"""Activation memory kept for backward, and step time, per activation-checkpointing mode.

    python bench/activation_checkpointing.py                 # the test's tiny Llama and a ~110M Llama
    python bench/activation_checkpointing.py --model 110m --seq 1024 --batch 2 --steps 3

Each mode prepares a fresh model with ``Accelerator(kwargs_handlers=[ActivationCheckpointingKwargs(...)])``
(one process) and runs one measured forward (``hasten.activation_checkpointing.measure_saved_bytes``):
"alive" is every byte the forward created and left alive for backward (outputs included), "autograd"
what autograd's saved-tensor hooks saw (a selective checkpoint keeps its matmul outputs outside them).
Then ``--steps`` timed steps (forward, backward, AdamW); on CUDA also the peak memory of a step.
Timings on a shared CPU machine say little; the byte counts do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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


def run(name: str, mode: str, batch: int, seq: int, steps: int) -> dict:
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
    if steps:  # warm-up step (--steps 0: the byte counts only)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    del loss
    times, peak = [], None
    cuda = acc.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        start = time.perf_counter()
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    return {"model": name, "params": params, "mode": mode, "batch": batch, "seq": seq, "alive": kept.alive,
            "autograd": kept.autograd, "step_s": statistics.median(times) if times else None, "peak": peak,
            "device": str(acc.device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--batch", type=int, default=None, help="default: 2 (tiny), 1 (110m)")
    parser.add_argument("--seq", type=int, default=None, help="default: 32 (tiny), 512 (110m)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the measured one (0: bytes only)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    for name in (MODELS if args.model == "both" else [args.model]):
        batch = args.batch or (2 if name == "tiny" else 1)
        seq = args.seq or (32 if name == "tiny" else 512)
        base = None
        print(f"\n{name}: batch {batch} x seq {seq}")
        print(f"{'mode':<14}{'kept (alive)':>16}{'ratio':>8}{'autograd':>14}{'step s':>9}{'vs none':>9}")
        for mode in MODES:
            row = run(name, mode, batch, seq, args.steps)
            base = base or row
            rows.append(row)
            step = f"{row['step_s']:.3f}" if row["step_s"] else "-"
            slower = f"{row['step_s'] / base['step_s']:.2f}x" if row["step_s"] and base["step_s"] else "-"
            print(f"{mode:<14}{row['alive']:>16,}{row['alive'] / base['alive']:>8.3f}{row['autograd']:>14,}"
                  f"{step:>9}{slower:>9}" + (f"  peak {row['peak']:,}" if row["peak"] else ""))
        print(f"({rows[-1]['params']:,} parameters, device {rows[-1]['device']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
