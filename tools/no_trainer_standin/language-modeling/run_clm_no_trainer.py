"""A stand-in for transformers' run_clm_no_trainer.py, written for hasten's harness (not a copy).

It takes the same command-line arguments the real script takes for local files and makes the same
Accelerate calls in the same order (trackers, save_state every N steps, load_state +
skip_first_batches on resume, gather_for_metrics, end_training then wait_for_everyone before
save_pretrained), so the harness and its test run without a transformers checkout. It reads its
json-lines files itself, so it runs without the ``datasets`` package. It is written
against ``accelerate`` on purpose: the harness replaces the word, as it does for the real scripts.
"""

import argparse
import json
import math
import os

import torch
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args():
    parser = argparse.ArgumentParser()
    for name in ("train_file", "validation_file", "model_name_or_path", "output_dir", "checkpointing_steps",
                 "resume_from_checkpoint"):
        parser.add_argument(f"--{name}", type=str, default=None)
    for name, default in (("per_device_train_batch_size", 8), ("per_device_eval_batch_size", 8),
                          ("num_train_epochs", 3), ("block_size", 16), ("seed", None)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--report_to", type=str, default="all")
    return parser.parse_args()


def main():
    args = parse_args()
    tracking = {"log_with": args.report_to, "project_dir": args.output_dir} if args.with_tracking else {}
    accelerator = Accelerator(**tracking)
    if args.seed is not None:
        set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)

    def to_blocks(path):
        with open(path) as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        ids = sum(tokenizer(texts)["input_ids"], [])
        usable = len(ids) // args.block_size * args.block_size
        blocks = [torch.tensor(ids[i:i + args.block_size]) for i in range(0, usable, args.block_size)]
        return [{"input_ids": b, "labels": b.clone()} for b in blocks]

    with accelerator.main_process_first():
        data = {"train": to_blocks(args.train_file), "validation": to_blocks(args.validation_file)}
    train = DataLoader(data["train"], shuffle=True, collate_fn=default_data_collator,
                       batch_size=args.per_device_train_batch_size)
    evaluation = DataLoader(data["validation"], collate_fn=default_data_collator,
                            batch_size=args.per_device_eval_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    max_steps = args.num_train_epochs * math.ceil(len(train) / accelerator.num_processes)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                              num_training_steps=max_steps * accelerator.num_processes)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)
    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", {"lr": args.learning_rate, "epochs": args.num_train_epochs})

    completed, start_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        name = os.path.basename(args.resume_from_checkpoint.rstrip("/"))
        if name.startswith("epoch_"):
            start_epoch = int(name.split("_")[1]) + 1
            completed = start_epoch * len(train)
        else:
            completed = int(name.split("_")[1])
            start_epoch, resume_step = divmod(completed, len(train))
    every = int(args.checkpointing_steps) if args.checkpointing_steps and args.checkpointing_steps.isdigit() else None

    for epoch in range(start_epoch, args.num_train_epochs):
        model.train()
        total = 0.0
        batches = train
        if resume_step and epoch == start_epoch:
            batches = accelerator.skip_first_batches(train, resume_step)
        for batch in batches:
            loss = model(**batch).loss
            total += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            completed += 1
            if every and completed % every == 0 and args.output_dir:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed}"))
        model.eval()
        losses = []
        for batch in evaluation:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
        perplexity = math.exp(torch.cat(losses).mean().item())
        accelerator.print(f"epoch {epoch}: perplexity {perplexity:.3f}")
        if args.with_tracking:
            accelerator.log({"perplexity": perplexity, "train_loss": total.item() / len(train)}, step=completed)
        if args.checkpointing_steps == "epoch" and args.output_dir:
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    if args.with_tracking:
        accelerator.end_training()
    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
