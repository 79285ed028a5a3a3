"""Gradient norms (issue 24 item 6): the sharded/global norm code against torch.nn.utils on a plain
model, and on 2 real processes where a gradient exists on one rank only (no rank left waiting)."""

import math

import pytest
import torch
from torch import nn

from distributed import run_checks
from hasten.strategies.dtensor import clip_global_norm_, local_norm


def _model_with_grads(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 3), nn.Linear(3, 2)).to(dtype)
    model(torch.randn(4, 5, dtype=dtype)).pow(2).sum().backward()
    model[3].weight.grad = None  # some parameters have no gradient
    model[3].bias.grad = None
    return model


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipping, and a max that clips nothing
def test_clip_equals_torch_on_a_plain_model(norm_type, max_norm):
    ours, ref = _model_with_grads(), _model_with_grads()
    got = clip_global_norm_(ours.parameters(), max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got.dtype == want.dtype == torch.float32
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_local_norm_equals_torch(norm_type):
    model = _model_with_grads()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    want = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    torch.testing.assert_close(local_norm(grads, norm_type), want, rtol=1e-6, atol=0)


def test_mixed_dtypes_and_no_gradients():
    a, b = _model_with_grads(), _model_with_grads(torch.float64)
    params = list(a.parameters()) + list(b.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    want = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    torch.testing.assert_close(clip_global_norm_(params, 1e6).double(), want.double(), rtol=1e-6, atol=0)
    assert float(clip_global_norm_([nn.Parameter(torch.ones(2))], 1.0)) == 0.0


def test_no_fp64_copies_of_gradients():
    """The norm is taken by foreach kernels on the gradients as they are (no double() copy of each)."""
    model = _model_with_grads()
    seen = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() > 1:
                seen.append(getattr(func, "__name__", str(func)))
            return out

    with Watch():
        clip_global_norm_(model.parameters(), 0.05)
    assert not seen, seen


@pytest.fixture(scope="module")
def two():
    # A rank left waiting in a collective shows as a timeout (each check runs in well under 10 s).
    return run_checks("checks_grad_norms", world_size=2, timeout=120)


def test_fsdp2_gradient_on_one_rank_only_no_hang(two):
    values = two.assert_passed("check_grad_on_one_rank_only")
    assert values[0]["norm"] == values[1]["norm"]
    assert values[0]["norm"] == pytest.approx(values[0]["expected"], rel=1e-6)
    assert values[0]["norm"] > 0


def test_fsdp2_sharded_norm_equals_one_process(two):
    values = two.assert_passed("check_sharded_norm_equals_one_process")
    assert values[0] == values[1]


def test_fsdp2_grad_norm_same_collectives_whichever_gradients_exist(two):
    values = two.assert_passed("check_grad_norm_with_gradients_on_one_rank_only")
    assert values[0]["norm"] == values[1]["norm"]
    assert values[0]["norm"] == pytest.approx(values[0]["expected"], rel=1e-5) and values[0]["norm"] > 0


# -- issue 24 item 4: FSDP2 does not move the whole model to the device before sharding ----------------

class _RecordsMoves(nn.Module):
    """A model that notes every whole-module move (``Module.to``/``cuda``/``_apply``) made on it: under
    FSDP2 the only moves must be fully_shard's, shard by shard, so the full model never sits on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.register_buffer("scale", torch.ones(1))
        self.moves: list[str] = []

    def _apply(self, fn, recurse=True):  # every Module.to / cuda / half ... goes through here
        self.moves.append(getattr(fn, "__name__", repr(fn)))
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_prepare_makes_no_whole_model_move(one_process_fsdp, offload):
    """On CPU this shows that prepare() never calls Module.to (or any _apply) on the whole model under FSDP2,
    while every parameter and buffer still ends where training needs it; on CUDA the shards reach the GPU
    through fully_shard's own per-module move (peak GPU memory: bench/gpu_check.py measures it)."""
    from hasten import Accelerator
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, cpu_offload=offload, auto_wrap_policy="SIZE_BASED_WRAP",
                                         min_num_params=30))
    model = _RecordsMoves()
    model = acc.prepare(model)
    assert model.moves == [], model.moves
    home = "cpu" if offload else acc.device.type
    assert all(p.to_local().device.type == home for p in model.parameters())
    assert all(b.device.type == acc.device.type for b in model.buffers())
    model(torch.randn(2, 4, device=acc.device)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
