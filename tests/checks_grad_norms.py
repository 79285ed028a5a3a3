"""Rank side of test_grad_norms.py: FSDP2 on 2 processes where a gradient exists on one rank only."""

import torch
import torch.distributed as dist
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin


class Branchy(nn.Module):
    """A trunk every rank uses and a branch only rank 0's data reaches. The branch is an ignored module:
    FSDP2 itself needs every rank to produce the same sharded gradients, so a rank-dependent branch must
    stay outside its sharding (its gradients are then plain tensors, None where the branch was not used)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 8)
        self.branch = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        out = self.trunk(x)
        return (out + self.branch(x) if use_branch else out).pow(2).mean()


def check_grad_on_one_rank_only():
    """Clip the branch's gradients, which rank 1 does not have: every rank must take part in the same
    collectives (before the fix rank 1 returned at once and rank 0 waited in its all-reduce)."""
    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, ignored_modules="branch"))
    model = acc.prepare(Branchy())
    rank = acc.process_index
    torch.manual_seed(10 + rank)
    acc.backward(model(torch.randn(4, 6, device=acc.device), rank == 0))
    have = [p.grad is not None for p in model.branch.parameters()]
    assert have == [rank == 0] * 2, have
    own = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.branch.parameters()])
                                   ) if rank == 0 else torch.zeros(())
    norm = acc.clip_grad_norm_(model.branch.parameters(), 1e-3)
    # Plain (unsharded) gradients count as replicated: each rank adds its own squares / world size.
    both = torch.stack([own.double() ** 2, norm.double().cpu()])
    dist.all_reduce(both)
    expected = (both[0] / 2).sqrt()
    return {"norm": float(norm), "expected": float(expected), "sum_of_norms": float(both[1])}


def _prepared(acc: Accelerator):
    """The prepared model after one backward on this rank's data, and that data for every rank."""
    model = acc.prepare(Branchy())
    data = []
    for r in range(acc.num_processes):
        torch.manual_seed(10 + r)
        data.append(torch.randn(4, 6))
    rank = acc.process_index
    acc.backward(model(data[rank].to(acc.device), rank == 0))
    return model, data


def check_sharded_norm_equals_one_process():
    """Clipping the sharded trunk (DTensor gradients) gives the norm and clipped gradients of one process
    on both ranks' data (the mean of the ranks' losses, as FSDP2 averages), for norms 2, inf and 1."""
    out = {}
    for norm_type in (2.0, float("inf"), 1.0):
        reset_state()
        acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, ignored_modules="branch"))
        model, data = _prepared(acc)
        norm = acc.clip_grad_norm_(model.trunk.parameters(), 0.01, norm_type=norm_type)
        ref = Branchy()
        sum(ref(x, r == 0) for r, x in enumerate(data)).div(len(data)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.trunk.parameters(), 0.01, norm_type=norm_type)
        torch.testing.assert_close(norm.cpu(), want, rtol=1e-5, atol=0)
        for p, q in zip(model.trunk.parameters(), ref.trunk.parameters()):
            torch.testing.assert_close(p.grad.full_tensor().cpu(), q.grad, rtol=1e-5, atol=1e-8)
        out[str(norm_type)] = float(norm)
    return out


def check_grad_norm_with_gradients_on_one_rank_only():
    """``grad_norm`` (the micro-step norm) runs the all-reduces of the parameters' layouts, not of the
    gradients present: rank 1 drops every gradient and both ranks still meet in the same collectives."""
    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, ignored_modules="branch"))
    model, _ = _prepared(acc)
    trunk = list(model.trunk.parameters())
    own = sum(float(p.grad.to_local().pow(2).sum()) for p in trunk) if acc.process_index == 0 else 0.0
    if acc.process_index == 1:
        for p in trunk:
            p.grad = None
    norm = acc.strategy.grad_norm(trunk)
    total = torch.tensor([own, float(norm)], dtype=torch.float64)
    dist.all_reduce(total)
    return {"norm": float(norm), "expected": float(total[0]) ** 0.5}
