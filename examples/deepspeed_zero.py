"""Train a causal language model with DeepSpeed ZeRO-2 or ZeRO-3, set up in code.

    hasten launch --num_processes 8 examples/deepspeed_zero.py --model_name_or_path ./my-llama --zero_stage 3
    hasten launch --cpu --num_processes 2 examples/deepspeed_zero.py --tiny --output_dir out          # a try on CPU
    hasten launch --cpu --num_processes 2 examples/deepspeed_zero.py --tiny --output_dir out \
        --resume_from_checkpoint out/epoch_0

DeepSpeed must be installed (`pip install deepspeed`; on a machine without CUDA, `DS_BUILD_OPS=0`).
The loop is the plain one: `accelerator.backward` runs DeepSpeed's backward, `clip_grad_norm_`
sets the engine's clipping, `optimizer.step()` is the engine's step, and `save_state` writes the
engine's own (partitioned) checkpoint. With `--tiny` the model learns sequences that count upwards.
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig

from hasten import Accelerator, DeepSpeedPlugin
from hasten.utils import set_seed


def counting_sequences(n: int, vocab_size: int, length: int, seed: int) -> TensorDataset:
    """Sequences start, start+1, ... (mod vocab_size) from random starts."""
    starts = torch.randint(0, vocab_size, (n, 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset((starts + torch.arange(length)) % vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", help="a local folder or a Hub model name")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Llama built from a config")
    parser.add_argument("--zero_stage", type=int, choices=[2, 3], default=2)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8, help="per process")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--output_dir", default="deepspeed-out")
    parser.add_argument("--resume_from_checkpoint", help="a folder written by save_state (e.g. out/epoch_0)")
    args = parser.parse_args()
    if not args.tiny and not args.model_name_or_path:
        parser.error("give --model_name_or_path or --tiny")

    # The plugin builds DeepSpeed's config; batch sizes and accumulation are filled in from the loop.
    plugin = DeepSpeedPlugin(zero_stage=args.zero_stage, offload_optimizer_device="none",
                             offload_param_device="none", zero3_save_16bit_model=True)
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(42)

    if args.tiny:
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    vocab_size = model.config.vocab_size
    train_dataloader = DataLoader(counting_sequences(256, vocab_size, 16, seed=1), batch_size=args.batch_size,
                                  shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # One call: DeepSpeed builds one engine from the model and its optimizer.
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)

    steps_per_epoch = len(train_dataloader) // args.gradient_accumulation_steps
    starting_epoch = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        starting_epoch = int(os.path.basename(os.path.normpath(args.resume_from_checkpoint)).split("_")[-1]) + 1
        accelerator.print(f"resumed from {args.resume_from_checkpoint}: epoch {starting_epoch}, "
                          f"step {starting_epoch * steps_per_epoch}")

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        for (input_ids,) in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(input_ids=input_ids, labels=input_ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # clip the summed gradients, once per optimizer step
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            total_loss += loss.detach().float()
        train_loss = accelerator.reduce(total_loss / len(train_dataloader), reduction="mean")
        accelerator.print(f"epoch {epoch}: step {(epoch + 1) * steps_per_epoch} train loss {train_loss.item():.6f}")
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    # Consolidated weights as safetensors (under ZeRO-3 every process takes part in gathering them).
    accelerator.wait_for_everyone()
    accelerator.save_model(model, os.path.join(args.output_dir, "final"))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(os.path.join(args.output_dir, "final"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
