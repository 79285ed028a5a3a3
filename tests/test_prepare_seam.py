"""The seam between the Accelerator and its strategy: a strategy prepares a call's models and
optimizers (one by one, or jointly as DeepSpeed does) and returns what it built; only the
Accelerator records prepared objects. Checked here with a joint strategy of the test's own, on
one process, so the seam is exercised without DeepSpeed (tests/test_deepspeed.py runs the real one).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.prepared import Built, PrepareCall
from hasten.scheduler import AcceleratedScheduler
from hasten.strategies.single import SingleDeviceStrategy


@pytest.fixture
def fresh_state():
    from distributed import reset_state

    reset_state()
    yield
    reset_state()


class Engine(nn.Module):
    """Stands for an engine built from a model and its optimizer together."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class JointStrategy(SingleDeviceStrategy):
    """Builds one ``Engine`` from the call's model and optimizer; other models are evaluated only."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[PrepareCall] = []
        self.backward_steps: list[int] = []

    def prepare(self, call: PrepareCall) -> dict:
        self.calls.append(call)
        out = {}
        optimizers = [(i, o) for i, o, _ in call.items if isinstance(o, torch.optim.Optimizer)]
        owned = {id(p) for _, o in optimizers for g in o.param_groups for p in g["params"]}
        for i, obj, placement in call.items:
            if isinstance(obj, nn.Module) and any(id(p) in owned for p in obj.parameters()):
                out[i] = Built(obj, Engine(obj), "models")
            elif isinstance(obj, nn.Module):
                out[i] = call.one_by_one(obj, placement, evaluation_mode=True)
        for i, opt in optimizers:
            out[i] = Built(opt, call.one_by_one(opt, None), None)  # prepared (and recorded) by the facade
        return out

    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1, **kwargs) -> None:
        self.backward_steps.append(accumulation_steps)
        loss.backward(**kwargs)  # the engine would divide itself


def _accelerator(steps: int = 1) -> Accelerator:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=steps)
    acc.strategy = JointStrategy(acc.plan)
    acc.precision = acc.strategy.precision
    return acc


def test_the_accelerator_records_what_a_joint_strategy_built(fresh_state):
    acc = _accelerator(steps=2)
    model, frozen = nn.Linear(2, 1), nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    p_sched, p_model, p_frozen, p_opt, p_loader = acc.prepare(sched, model, frozen, opt, loader)

    call = acc.strategy.calls[0]
    assert call.dataloaders == [p_loader]  # dataloaders were prepared before the strategy's step
    assert call.accumulation_steps == 2
    assert isinstance(p_model, Engine) and p_model.module is model
    assert p_frozen is frozen
    assert acc._models == [p_frozen, p_model]  # recorded in the order they were prepared
    assert acc._optimizers == [p_opt]
    # The torch scheduler was left to the facade: prepared after the optimizer, which it follows.
    assert isinstance(p_sched, AcceleratedScheduler) and acc._schedulers == [p_sched]
    assert p_sched.optimizers == [p_opt]
    # Preparing again hands back the same objects and builds nothing.
    assert acc.prepare(model, opt, sched, loader) == (p_model, p_opt, p_sched, p_loader)
    assert acc.prepare(p_model) is p_model
    assert [c.items for c in acc.strategy.calls[1:]] == [[], []]
    assert len(acc._models) == 2 and len(acc._optimizers) == 1


def test_a_value_built_for_no_list_is_handed_back_unrecorded(fresh_state):
    acc = _accelerator()

    class Marker(SingleDeviceStrategy):
        def prepare(self, call: PrepareCall) -> dict:
            return {i: Built(obj, ("handed back", obj), None) for i, obj, _ in call.items}

    acc.strategy = Marker(acc.plan)
    model = nn.Linear(1, 1)
    assert acc.prepare(model) == ("handed back", model)
    assert acc._models == [] and acc._prepared.get(model) is None


def test_backward_hands_the_accumulation_steps_to_the_strategy(fresh_state):
    acc = _accelerator(steps=4)
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _ = acc.prepare(model, opt)
    acc.backward(engine(torch.ones(1, 2)).sum())
    assert acc.strategy.backward_steps == [4]
    assert torch.equal(model.weight.grad, torch.ones(1, 2))  # undivided: the strategy scales the loss itself


def test_the_default_strategy_divides_the_loss_by_the_accumulation_steps(fresh_state):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = nn.Linear(2, 1, bias=False)
    model = acc.prepare(model)
    acc.backward(model(torch.ones(1, 2, device=acc.device)).sum())
    assert torch.equal(acc.unwrap_model(model).weight.grad, torch.full((1, 2), 0.25, device=acc.device))


def test_unknown_registry_list_is_refused():
    from hasten.prepared import PreparedObjects

    with pytest.raises(ValueError, match="'engines'"):
        PreparedObjects().add(object(), object(), "engines")


def test_deepspeed_config_placeholders_are_refused_by_other_strategies_before_anything_is_prepared(fresh_state):
    from hasten.utils import DummyOptim, DummyScheduler

    acc = Accelerator()
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"DummyOptim \(argument 1\), which stands for the optimizer defined in a DeepSpeed"):
        acc.prepare(model, DummyOptim(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"DummyScheduler \(argument 2\).*create a real one"):
        acc.prepare(model, opt, DummyScheduler(opt))
    assert acc._models == [] and acc._optimizers == []
