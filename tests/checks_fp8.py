"""fp8 (torchao) under DDP, run inside each of 2 ranks. See distributed.py.

The reference (``fp8_common.per_shard_reference``) is computed in the same process with plain
PyTorch, on the rank's device.
"""

import torch

from fp8_common import loss_of, make_data, make_model, per_shard_reference
from hasten import Accelerator
from hasten.utils import AORecipeKwargs
from hasten.utils.operations import gather

BATCH = 8  # per rank


def _ddp_run(steps, accumulate):
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config="tensorwise")],
                      gradient_accumulation_steps=accumulate)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    x, y = make_data(device=acc.device)
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
    ref = per_shard_reference(4, accumulate, BATCH, device=acc.device)
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        both = gather(p.detach()[None])
        assert torch.equal(both[0], both[1]), f"{name} differs between ranks"
        worst = max(worst, (p.detach() - q).abs().max().item())
    # Averaging in another order than the backend's bucket may round the last bit differently.
    assert worst <= 1e-6, worst
    return worst


def check_ddp_matches_per_shard_reference():
    return _compare(accumulate=1)


def check_ddp_with_gradient_accumulation():
    return _compare(accumulate=2)
