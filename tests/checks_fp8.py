"""fp8 (torchao) under DDP, run inside each of 2 ranks over gloo. See distributed.py.

The reference is computed in the same process with plain PyTorch: the hand-converted model
takes each rank's shard in turn and the two gradients are averaged, which is exactly what DDP
does; with float8 the scales are per shard, so a single big batch would not be the same thing.
"""

import torch

from fp8_common import loss_of, make_data, make_model, reference_forward, reference_model
from hasten import Accelerator
from hasten.utils import AORecipeKwargs
from hasten.utils.operations import gather

BATCH = 8  # per rank


def _reference(steps, accumulate):
    model = reference_model("tensorwise")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data()
    grads = None
    for step in range(steps):
        per_rank = []
        for rank in range(2):
            start = (step * 2 + rank) * BATCH
            model.zero_grad()
            (loss_of(reference_forward(model, x[start:start + BATCH]), y[start:start + BATCH]) / accumulate).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        mean = [(a / 2) + (b / 2) for a, b in zip(*per_rank)]  # DDP divides, then sums
        grads = mean if grads is None else [g + m for g, m in zip(grads, mean)]
        if (step + 1) % accumulate == 0:
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
            grads = None
    return model


def _ddp_run(steps, accumulate):
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config="tensorwise")],
                      gradient_accumulation_steps=accumulate)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    x, y = make_data()
    for step in range(steps):
        start = (step * 2 + acc.process_index) * BATCH
        with acc.accumulate(model):
            acc.backward(loss_of(model(x[start:start + BATCH]), y[start:start + BATCH]))
            opt.step()
            opt.zero_grad()
    return acc, acc.unwrap_model(model)


def _compare(accumulate):
    acc, model = _ddp_run(4, accumulate)
    assert type(model[2]).__name__ == "Float8Linear" and type(model[0]).__name__ == "Linear"
    ref = _reference(4, accumulate)
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        both = gather(p.detach()[None])
        assert torch.equal(both[0], both[1]), f"{name} differs between ranks"
        worst = max(worst, (p.detach() - q).abs().max().item())
    # Averaging in another order than gloo's bucket may round the last bit differently.
    assert worst <= 1e-6, worst
    return worst


def check_ddp_matches_per_shard_reference():
    return _compare(accumulate=1)


def check_ddp_with_gradient_accumulation():
    return _compare(accumulate=2)
