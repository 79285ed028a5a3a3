"""Checks run in 2 real processes by tests/test_hook_models.py."""

import os

import torch
from torch import nn

from hasten import Accelerator


class Net(nn.Module):
    """A model with diffusers' ``save_pretrained`` / ``from_pretrained`` shape (one safetensors file)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        return self.layer(x)

    def save_pretrained(self, folder):
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(folder, "net.safetensors"))


def check_hooks_see_the_modules_ddp_wraps():
    """diffusers' hooks, as train_unconditional.py writes them: the save hook calls
    ``model.save_pretrained`` on process 0 and pops the weights; the load hook pops the model and loads
    it with ``model.load_state_dict`` (keys without DDP's ``module.`` prefix)."""
    from safetensors.torch import load_file

    acc = Accelerator()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    seen = {"save": [], "load": []}

    def save_hook(models, weights, folder):
        seen["save"] += [type(m).__name__ for m in models]
        if acc.is_main_process:
            for m in models:
                m.save_pretrained(os.path.join(folder, "net"))
                weights.pop()

    def load_hook(models, folder):
        seen["load"] += [type(m).__name__ for m in models]
        for _ in range(len(models)):
            m = models.pop()
            m.load_state_dict(load_file(os.path.join(folder, "net", "net.safetensors")))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    acc.backward(model(torch.randn(2, 4, device=acc.device)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    saved = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "hook_models")
    acc.save_state(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(folder)
    restored = acc.unwrap_model(model).state_dict()
    return {"prepared": type(model).__name__, "seen": seen,
            "restored": all(torch.equal(restored[k], saved[k]) for k in saved)}
