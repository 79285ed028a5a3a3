"""Throughput you can see: tokens/s, FLOP/s, MFU and step times of a small language model's training.

    hasten launch --cpu --num_processes 2 examples/throughput.py --steps 40
    HASTEN_AVAILABLE_FLOPS=1e11 hasten launch --cpu --num_processes 2 examples/throughput.py   # MFU on CPU

The FLOPs of one step are counted once, by torch's FLOP counter, on a copy of the model built on the meta
device (no memory, no compute). Every process updates the monitor with its own counts; every process calls
``compute_and_log`` (it gathers figures from all of them), and the trackers of ``log_with`` get them.
``hasten launch`` prints the job's last figures in its closing line. On a GPU the peak FLOP/s come from
hasten's table for the device and the precision; on a CPU pass your own (HASTEN_AVAILABLE_FLOPS).
"""

import argparse
import json
import time

import torch
from torch import nn

from hasten import Accelerator
from hasten.utils import ThroughputMonitor, measure_flops, set_seed


class TinyLM(nn.Module):
    """Embedding, a few residual MLP blocks, and a head over the vocabulary."""

    def __init__(self, vocab: int = 256, width: int = 64, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per process and step")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--log_every", type=int, default=4)
    parser.add_argument("--log_with", default=None, help="trackers for accelerator.log, e.g. tensorboard")
    args = parser.parse_args()

    accelerator = Accelerator(log_with=args.log_with, project_dir="runs" if args.log_with else None)
    set_seed(0)
    vocab = 256
    loss_fn = nn.CrossEntropyLoss()

    # FLOPs of one training step of one process, counted on a meta-device copy of the model.
    with torch.device("meta"):
        meta_model = TinyLM(vocab)
        meta_tokens = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
    flops_per_batch = measure_flops(meta_model, lambda: meta_model(meta_tokens),
                                    lambda logits: loss_fn(logits.flatten(0, 1), meta_tokens.flatten()))

    model = TinyLM(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    if args.log_with:
        accelerator.init_trackers("throughput")
    monitor = ThroughputMonitor(accelerator, window_size=args.log_every)

    generator = torch.Generator().manual_seed(accelerator.process_index)  # cpu-on-purpose: data made here
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=generator).to(accelerator.device)
        logits = model(tokens)
        loss = loss_fn(logits.flatten(0, 1), tokens.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss.item()  # waits for the device, so the clock below measures work done, not work queued
        monitor.update(time=time.perf_counter() - start, batches=step, samples=step * args.batch_size,
                       lengths=step * args.batch_size * args.seq_len, flops_per_batch=flops_per_batch)
        if step % args.log_every == 0:
            metrics = monitor.compute_and_log(step)  # on every process: it gathers from all of them
            if accelerator.is_main_process:
                print("metrics " + json.dumps(metrics), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
