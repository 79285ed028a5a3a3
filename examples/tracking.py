"""Experiment tracking: the training loop of examples/train.py, logging to every installed tracker.

    hasten launch --cpu --num_processes 2 examples/tracking.py --with_tracking --project_dir runs
    tensorboard --logdir runs          # (with tensorboard installed) to look at the curves

`--log_with` picks the trackers ("all", the default, means every installed one: pip install
'hasten[tensorboard]', 'hasten[wandb]', ...). Only the main process creates runs and writes.
For trackers that talk to a service, set their offline switch to try this without an account:
WANDB_MODE=offline, MLFLOW_TRACKING_URI=sqlite:///mlflow.db, SWANLAB_MODE=offline, ...
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader

from hasten import Accelerator
from hasten.utils import set_seed
from train import Classifier, make_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with_tracking", action="store_true", help="log to the trackers of --log_with")
    parser.add_argument("--log_with", default="all", help='"all", or tracker names separated by commas')
    parser.add_argument("--project_dir", default="runs", help="where trackers that write files put them")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    config = {"lr": args.lr, "epochs": args.epochs, "batch_size": args.batch_size, "seed": 42}

    if args.with_tracking:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                                  log_with=args.log_with.split(","), project_dir=args.project_dir)
    else:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])

    train_dataloader = DataLoader(make_dataset(2048, seed=1), batch_size=args.batch_size, shuffle=True)
    eval_dataloader = DataLoader(make_dataset(512, seed=2), batch_size=64)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    if args.with_tracking:
        # The run is named after this file; the config is stored with it.
        accelerator.init_trackers(os.path.splitext(os.path.basename(__file__))[0], config)

    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        for points, labels in train_dataloader:
            loss = loss_fn(model(points), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total_loss += loss.detach().float()

        model.eval()
        correct = seen = 0
        for points, labels in eval_dataloader:
            with torch.no_grad():
                predictions = model(points).argmax(dim=-1)
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == labels).sum().item()
            seen += labels.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / seen:.4f}")
        if args.with_tracking:
            # A one-element tensor is logged as a number; every process may call log, only the main one writes.
            accelerator.log({"accuracy": correct / seen, "train_loss": total_loss / len(train_dataloader),
                             "epoch": epoch}, step=epoch)

    accelerator.end_training()  # finishes the runs


if __name__ == "__main__":
    main()
