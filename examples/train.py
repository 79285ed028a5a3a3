"""The seeds' training loop as a complete script: a small classifier on data it makes itself.

Run it on one process:            python examples/train.py
on two CPU processes:             hasten launch --cpu --num_processes 2 examples/train.py
or with torch's own launcher:     torchrun --nproc_per_node 2 examples/train.py

The lines marked `# hasten` are all that differs from a plain single-device PyTorch loop.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator  # hasten
from hasten.utils import set_seed


def make_dataset(n: int, seed: int) -> TensorDataset:
    """Points in 8 dimensions, labelled by which of 4 noisy clusters they come from."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 2.5
    labels = torch.randint(0, 4, (n,), generator=g)
    points = centers[labels] + torch.randn(n, 8, generator=g)
    return TensorDataset(points, labels)


class Classifier(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 4))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.net(points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.cpu,  # hasten
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)

    train_dataloader = DataLoader(make_dataset(4096, seed=1), batch_size=args.batch_size, shuffle=True)
    eval_dataloader = DataLoader(make_dataset(1000, seed=2), batch_size=64)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The schedule is written for one process; the prepared scheduler keeps it right on N.
    num_training_steps = args.epochs * math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / num_training_steps))

    train_dataloader, eval_dataloader, model, optimizer, lr_scheduler = accelerator.prepare(  # hasten
        train_dataloader, eval_dataloader, model, optimizer, lr_scheduler
    )
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        model.train()
        total_loss, batches = 0.0, 0
        for points, labels in train_dataloader:  # batches arrive on accelerator.device
            with accelerator.accumulate(model):
                loss = loss_fn(model(points), labels)
                accelerator.backward(loss)  # hasten: was loss.backward()
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            total_loss += loss.detach()
            batches += 1
        mean_loss = accelerator.reduce(total_loss / batches, reduction="mean")

        model.eval()
        correct, seen = 0, 0
        for points, labels in eval_dataloader:
            with torch.no_grad():
                predictions = model(points).argmax(dim=-1)
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == labels).sum().item()
            seen += labels.numel()
        accelerator.print(
            f"epoch {epoch}: train loss {mean_loss.item():.4f}  eval accuracy {correct / seen:.4f} "
            f"({seen} samples, {accelerator.num_processes} process(es), lr {lr_scheduler.get_last_lr()[0]:.2e})"
        )

    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
