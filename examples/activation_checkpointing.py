"""Activation checkpointing with one setting, whatever the strategy: a small Llama trained on tokens
it makes itself, its decoder layers checkpointed at prepare.

Run it on one process:            python examples/activation_checkpointing.py --mode selective
on two CPU processes (DDP):       hasten launch --cpu --num_processes 2 examples/activation_checkpointing.py
with FSDP2:                       hasten launch --cpu --num_processes 2 --use_fsdp --fsdp_version 2 \\
                                      examples/activation_checkpointing.py --mode every_k --every 2

The first step prints how many bytes of activations the forward kept for backward; compare
``--mode none`` with the others. The lines marked `# hasten` are all that differs from a plain loop.
"""

import argparse

import torch

from hasten import Accelerator  # hasten
from hasten.activation_checkpointing import measure_saved_bytes
from hasten.utils import ActivationCheckpointingKwargs, set_seed  # hasten


def build_model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, use_cache=False)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="full", choices=["none", "full", "selective", "every_k"])
    parser.add_argument("--every", type=int, default=None, help="with --mode every_k: checkpoint every k-th layer")
    parser.add_argument("--offload", action="store_true", help="keep the checkpointed layers' inputs in host memory")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    handlers = []
    if args.mode != "none":
        handlers.append(ActivationCheckpointingKwargs(mode=args.mode, every=args.every, offload=args.offload))  # hasten
    accelerator = Accelerator(kwargs_handlers=handlers)  # hasten
    set_seed(0)
    model = build_model(args.layers, args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)  # hasten
    generator = torch.Generator().manual_seed(1 + accelerator.process_index)
    for step in range(args.steps):
        ids = torch.randint(0, 256, (4, args.seq), generator=generator).to(accelerator.device)
        if step == 0:
            with measure_saved_bytes(model) as kept:
                loss = model(input_ids=ids, labels=ids).loss
            accelerator.print(f"mode={args.mode}: {kept.alive / 2**20:.2f} MiB kept for backward by the forward "
                              f"({kept.autograd / 2**20:.2f} MiB through autograd's saved tensors)")
        else:
            loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)  # hasten
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}")  # hasten
    accelerator.end_training()  # hasten


if __name__ == "__main__":
    main()
