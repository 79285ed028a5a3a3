"""Fine-tune a transformers sequence classifier, the way transformers' `*_no_trainer.py` scripts do.

Real use (a local folder or a Hub name, and a CSV file with `text` and `label` columns):
    hasten launch examples/finetune_transformers.py --model_name_or_path ./my-bert --train_file train.csv
A self-contained try (a tiny model built from a config, generated token ids, no tokenizer):
    hasten launch --cpu --num_processes 2 examples/finetune_transformers.py --tiny --output_dir out
Continue an interrupted run from the checkpoint of a finished epoch:
    hasten launch ... --resume_from_checkpoint out/epoch_0

For Accelerate users: only the import line differs.
"""

import argparse
import csv
import math
import os

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from hasten import Accelerator
from hasten.utils import set_seed


def tiny_model_and_data(seed: int):
    """A 2-layer Llama classifier and sequences whose label says which half of the vocabulary they use."""
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    model = AutoModelForSequenceClassification.from_config(config)

    def make(n: int, data_seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(data_seed)
        labels = torch.randint(0, 2, (n,), generator=g)
        input_ids = torch.randint(1, 32, (n, 16), generator=g) + 31 * labels[:, None]  # id 0 is the pad token
        return TensorDataset(input_ids, torch.ones_like(input_ids), labels)

    return model, make(512, seed + 1), make(128, seed + 2), None


def pretrained_model_and_data(name_or_path: str, train_file: str, validation_file: str):
    """A pretrained checkpoint (folder or Hub name) with its tokenizer, and CSV files of `text,label` rows."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)

    def read(path: str) -> TensorDataset:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        encoded = tokenizer([r["text"] for r in rows], padding="max_length", truncation=True, max_length=128,
                            return_tensors="pt")
        labels = torch.tensor([int(r["label"]) for r in rows])
        return TensorDataset(encoded["input_ids"], encoded["attention_mask"], labels)

    train, evaluation = read(train_file), read(validation_file or train_file)
    num_labels = int(max(train.tensors[2].max(), evaluation.tensors[2].max())) + 1
    model = AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=num_labels)
    if model.config.pad_token_id is None:  # decoder-only models need it to find each sequence's last token
        pad = tokenizer.pad_token_id
        model.config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    return model, train, evaluation, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", help="a local folder or a Hub model name")
    parser.add_argument("--train_file", help="CSV with text,label columns (with --model_name_or_path)")
    parser.add_argument("--validation_file", help="CSV with text,label columns (default: the train file)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and data made here (for tests)")
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--output_dir", default="finetuned")
    parser.add_argument("--resume_from_checkpoint", help="a folder written by save_state (e.g. out/epoch_0)")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    if not args.tiny and not (args.model_name_or_path and args.train_file):
        parser.error("give --model_name_or_path and --train_file, or --tiny")

    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)  # before the model is built, so every process starts from the same weights

    if args.tiny:
        model, train_set, eval_set, tokenizer = tiny_model_and_data(args.seed)
    else:
        with accelerator.main_process_first():  # one process downloads, the others then read the cache
            model, train_set, eval_set, tokenizer = pretrained_model_and_data(args.model_name_or_path, args.train_file,
                                                                   args.validation_file)
    train_dataloader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True)
    eval_dataloader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size)

    # No weight decay on biases and norm weights, as the transformers scripts do.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate)
    # Counted in optimizer steps of one process; the prepared scheduler stays right on N processes.
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * steps_per_epoch
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.num_warmup_steps, max_train_steps)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)  # now per process

    starting_epoch = 0
    if args.resume_from_checkpoint:
        # Restores model, optimizer, scheduler, gradient scaler, RNGs and the dataloaders' epoch.
        accelerator.load_state(args.resume_from_checkpoint)
        starting_epoch = int(os.path.basename(os.path.normpath(args.resume_from_checkpoint)).split("_")[-1]) + 1
        accelerator.print(f"resumed from {args.resume_from_checkpoint}: epoch {starting_epoch}, "
                          f"step {starting_epoch * steps_per_epoch}")

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        for input_ids, attention_mask, labels in train_dataloader:
            with accelerator.accumulate(model):  # syncs gradients and steps only every N batches
                outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
                accelerator.backward(outputs.loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            total_loss += outputs.loss.detach().float()
        train_loss = accelerator.reduce(total_loss / len(train_dataloader), reduction="mean")

        model.eval()
        correct = seen = 0
        for input_ids, attention_mask, labels in eval_dataloader:
            with torch.no_grad():
                predictions = model(input_ids=input_ids, attention_mask=attention_mask).logits.argmax(dim=-1)
            # Drops the samples repeated to even out the last batch, so each one counts once.
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == labels).sum().item()
            seen += labels.numel()
        accelerator.print(f"epoch {epoch}: step {(epoch + 1) * steps_per_epoch} train loss {train_loss.item():.6f} "
                          f"eval accuracy {correct / seen:.4f} ({seen} samples)")
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    # Weights and config in the usual transformers layout: `from_pretrained(output_dir)` reads them back.
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if tokenizer is not None and accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
