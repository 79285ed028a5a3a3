"""Train a causal language model with FSDP2, set up in code (no config file needed).

    hasten launch --num_processes 8 examples/fsdp2.py --model_name_or_path ./my-llama   # one node, 8 GPUs
    hasten launch --cpu --num_processes 2 examples/fsdp2.py --tiny --output_dir out     # a try on CPU
    hasten launch --cpu --num_processes 2 examples/fsdp2.py --tiny --output_dir out --resume_from_checkpoint out/epoch_0

Each process holds a shard of every parameter, gradient and optimizer state. `save_state` writes
those shards (each process its own, no gathering); `get_state_dict` gathers full weights for
`save_pretrained`. With `--tiny` the model learns sequences that count upwards modulo the vocabulary.
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig

from hasten import Accelerator
from hasten.utils import FullyShardedDataParallelPlugin, set_seed


def counting_sequences(n: int, vocab_size: int, length: int, seed: int) -> TensorDataset:
    """Sequences start, start+1, ... (mod vocab_size) from random starts: easy to learn, quick to check."""
    starts = torch.randint(0, vocab_size, (n, 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset((starts + torch.arange(length)) % vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", help="a local folder or a Hub model name")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Llama built from a config")
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8, help="per process")
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--output_dir", default="fsdp2-out")
    parser.add_argument("--resume_from_checkpoint", help="a folder written by save_state (e.g. out/epoch_0)")
    args = parser.parse_args()
    if not args.tiny and not args.model_name_or_path:
        parser.error("give --model_name_or_path or --tiny")

    # FSDP2, one shard group per decoder layer (the classes in the model's `_no_split_modules`).
    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                                 state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=fsdp_plugin, mixed_precision=args.mixed_precision)
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
    eval_dataloader = DataLoader(counting_sequences(64, vocab_size, 16, seed=2), batch_size=args.batch_size)

    # Prepare the model before building the optimizer, or together as here: hasten points the
    # optimizer at the sharded parameters either way.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)

    starting_epoch = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)  # each process reads its own shards back
        starting_epoch = int(os.path.basename(os.path.normpath(args.resume_from_checkpoint)).split("_")[-1]) + 1
        accelerator.print(f"resumed from {args.resume_from_checkpoint}: epoch {starting_epoch}, "
                          f"step {starting_epoch * len(train_dataloader)}")

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        for (input_ids,) in train_dataloader:
            loss = model(input_ids=input_ids, labels=input_ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total_loss += loss.detach()
        train_loss = accelerator.reduce(total_loss / len(train_dataloader), reduction="mean")

        model.eval()
        correct = seen = 0
        for (input_ids,) in eval_dataloader:
            with torch.no_grad():  # next-token accuracy
                predictions = model(input_ids=input_ids).logits[:, :-1].argmax(dim=-1)
            predictions, targets = accelerator.gather_for_metrics((predictions, input_ids[:, 1:]))
            correct += (predictions == targets).sum().item()
            seen += targets.numel()
        accelerator.print(f"epoch {epoch}: step {(epoch + 1) * len(train_dataloader)} "
                          f"train loss {train_loss.item():.6f} eval accuracy {correct / seen:.4f}")
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    # Full (unsharded) weights: every process takes part in the gathering, the main process writes.
    state_dict = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        os.path.join(args.output_dir, "final"), state_dict=state_dict,
        is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    accelerator.end_training()


if __name__ == "__main__":
    main()
