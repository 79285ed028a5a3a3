"""FSDP2's root under hasten (see test_fsdp2_root_reshard.py): which parameters stay gathered after forward."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distributed import reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

VOCAB, HIDDEN = 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _gathered(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are the gathered (whole) tensors rather than the DTensor shards."""
    return not any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def _parts(model: nn.Module) -> list:
    """(head, embedding: the root's own parameters; a block's linear: resharded after forward by FSDP itself)"""
    return [_gathered(model.head), _gathered(model.embed), _gathered(model.blocks[0].mlp[0])]


def check_trained_root_stays_gathered_until_backward_frozen_root_is_freed():
    reset_state()
    plugin = Plugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
    acc = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    trained, frozen = LM(), LM().eval().requires_grad_(False)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    trained, opt, frozen = acc.prepare(trained, opt, frozen)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(acc.process_index)).to(acc.device)
    seen = []
    for _ in range(2):
        with torch.no_grad():
            reference = frozen(ids)
            trained(ids)  # evaluation of the trained model: nothing follows to free its root
        evaluated = _parts(trained)
        frozen_after = _parts(frozen)
        logits = trained(ids)
        trained_after = _parts(trained)
        loss = (logits.float().log_softmax(-1) - reference.float().log_softmax(-1)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        seen.append({"frozen": frozen_after, "trained": trained_after, "evaluated": evaluated,
                     "trained_after_step": _parts(trained), "loss": float(loss)})
    acc.end_training()
    return seen
