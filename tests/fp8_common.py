"""Tiny models, data and a plain-PyTorch fp8 reference shared by the fp8 tests (in-process and DDP).

References run on the device they are given (the Accelerator's), CPU by default."""

import torch
from torch import nn

DIM = 32


def make_model(seed: int = 0) -> nn.Sequential:
    """Four Linear layers: the default filter converts the two inner ones (dimensions 32)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.ReLU(),
                         nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, 4))


def make_data(n: int = 64, seed: int = 1, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x[:, :4] * 2) + 0.05 * torch.randn(n, 4, generator=g)
    return x.to(device), y.to(device)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def reference_model(recipe: str = "tensorwise", seed: int = 0, device="cpu") -> nn.Module:
    """What hasten should build, made by hand: torchao conversion of the two inner layers."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = make_model(seed).to(device)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, fqn: fqn in ("2", "4"))
    return model


def reference_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        return model(x).float()


def per_shard_reference(steps: int, accumulate: int, batch: int, lr: float = 0.05, device="cpu") -> nn.Module:
    """One process doing what 2 data-parallel ranks do, in plain PyTorch + torchao: rank r's batch
    of step s is ``x[(2s + r) * batch % len(x):][:batch]``; each rank's gradient is computed on its own shard
    and the two are averaged (with float8 the activation scales are per shard, so one big batch
    would not be the same thing); SGD steps every ``accumulate`` micro-steps."""
    model = reference_model("tensorwise", device=device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = make_data(device=device)
    grads = None
    for step in range(steps):
        per_rank = []
        for rank in range(2):
            start = ((step * 2 + rank) * batch) % len(x)
            model.zero_grad()
            (loss_of(reference_forward(model, x[start:start + batch]), y[start:start + batch]) / accumulate).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        mean = [(a / 2) + (b / 2) for a, b in zip(*per_rank)]  # DDP divides, then sums
        grads = mean if grads is None else [g + m for g, m in zip(grads, mean)]
        if (step + 1) % accumulate == 0:
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
            grads = None
    return model
