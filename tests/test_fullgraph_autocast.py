"""A model prepared with bf16/fp16 and then compiled by the user with ``fullgraph=True``: dynamo
traces hasten's autocast hooks into the one graph, the numbers are eager autocast's, and the
autocast is always left (a forward that raises, eagerly or while traced, included)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hasten import Accelerator

pytestmark = pytest.mark.usefixtures("fresh_state")


class Net(nn.Module):
    """Two layers; ``fail=True`` raises between them (after the autocast was entered)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, fail: bool = False) -> dict[str, torch.Tensor]:
        hidden = self.a(x)
        if fail:
            raise ValueError("forward fails on purpose")
        return {"hidden": hidden, "out": self.b(torch.relu(hidden))}


class Outer(nn.Module):
    """Calls a module that was prepared on its own (its hooks run inside this module's)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)["out"]) + self.inner(x)["out"].sum()


class Counting:
    """A dynamo backend that counts the graphs it is given and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return graph_module.forward


def _low(mode: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def _eager_autocast(model: nn.Module, x: torch.Tensor, mode: str) -> object:
    with torch.autocast(x.device.type, dtype=_low(mode)):
        return model(x)


def _autocast_on(device: torch.device) -> bool:
    return torch.is_autocast_enabled(device.type)


@pytest.mark.parametrize("mode,backend", [("bf16", "counting"), ("bf16", "aot_eager"), ("fp16", "counting")])
def test_user_fullgraph_compile_gives_eager_autocast_numbers(mode: str, backend: str) -> None:
    torch._dynamo.reset()
    acc = Accelerator(mixed_precision=mode)
    torch.manual_seed(0)
    model = Net().to(acc.device)
    reference = copy.deepcopy(model)
    prepared = acc.prepare(model)
    counting = Counting()
    compiled = torch.compile(prepared, fullgraph=True, backend=counting if backend == "counting" else backend)
    x = torch.randn(8, 16, device=acc.device)
    expected = _eager_autocast(reference, x, mode)
    out = compiled(x)  # fullgraph=True: a graph break raises
    assert not _autocast_on(acc.device)
    for key in ("hidden", "out"):
        assert out[key].dtype == torch.float32
        assert torch.equal(out[key], expected[key].float())
    assert torch.equal(prepared(x)["out"], out["out"])  # the same hooks, not compiled
    (out["out"].float().pow(2).mean()).backward()
    expected["out"].float().pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    if backend == "counting":
        assert counting.graphs == 1


def test_fullgraph_with_a_prepared_module_inside_another() -> None:
    torch._dynamo.reset()
    acc = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    inner = acc.prepare(Net().to(acc.device))
    outer = acc.prepare(Outer(inner).to(acc.device))
    reference = copy.deepcopy(outer)
    x = torch.randn(5, 16, device=acc.device)
    expected = outer(x)  # eager: the inner region is entered twice inside the outer one
    assert expected.dtype == torch.float32 and not _autocast_on(acc.device)
    counting = Counting()
    out = torch.compile(outer, fullgraph=True, backend=counting)(x)
    assert torch.equal(out, expected) and counting.graphs == 1
    assert not _autocast_on(acc.device)
    with torch.autocast(acc.device.type, dtype=torch.bfloat16):
        # The inner outputs come back in fp32 and are cast again by the outer autocast: the same ops.
        plain = reference.inner.b(torch.relu(reference.inner.a(x))).float()
        again = reference.head(plain) + plain.sum()
    assert torch.equal(out, again.float())


@pytest.mark.parametrize("backend", ["counting", "aot_eager"])
def test_fullgraph_of_a_torch_nn_container_traces_the_hooks_into_the_graph(backend: str) -> None:
    """dynamo inlines a ``torch.nn`` module's call with its hooks (a user-defined module's hooks
    run outside the graph): the autocast is entered and left inside the one graph."""
    torch._dynamo.reset()
    acc = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(acc.device)
    reference = copy.deepcopy(model)
    prepared = acc.prepare(model)
    counting = Counting()
    compiled = torch.compile(prepared, fullgraph=True, backend=counting if backend == "counting" else backend)
    x = torch.randn(6, 16, device=acc.device)
    out = compiled(x)
    assert not _autocast_on(acc.device)
    assert out.dtype == torch.float32 and torch.equal(out, _eager_autocast(reference, x, "bf16").float())
    assert backend != "counting" or counting.graphs == 1


class Caller(nn.Module):
    """A plain module around a prepared one (whose hooks dynamo then inlines)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        out = self.inner(x, fail=fail) if fail else self.inner(x)
        return (out["out"] if isinstance(out, dict) else out) * 2


def test_the_autocast_is_left_when_forward_raises_eager_and_compiled() -> None:
    torch._dynamo.reset()
    acc = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = acc.prepare(Net().to(acc.device))
    x = torch.randn(4, 16, device=acc.device)
    good = model(x)["out"]
    with pytest.raises(ValueError, match="on purpose"):
        model(x, fail=True)
    assert not _autocast_on(acc.device)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    # Under fullgraph dynamo reports a raise met while tracing as its own Unsupported, naming it.
    with pytest.raises(Exception, match="on purpose"):
        compiled(x, fail=True)
    assert not _autocast_on(acc.device)
    assert torch.equal(compiled(x)["out"], good) and not _autocast_on(acc.device)
    assert torch.equal(model(x)["out"], good)  # nothing of the failed calls is left on hasten's side
    caller = torch.compile(Caller(model), fullgraph=True, backend="eager")  # the hooks inlined, traced
    with pytest.raises(Exception, match="on purpose"):
        caller(x, fail=True)
    assert not _autocast_on(acc.device)
    assert torch.equal(caller(x), good * 2) and not _autocast_on(acc.device)


def test_a_user_autocast_disabled_region_is_kept_under_fullgraph() -> None:
    """AutocastKwargs(enabled=False) leaves the caller's own autocast alone, compiled or not."""
    from hasten.utils import AutocastKwargs

    torch._dynamo.reset()
    acc = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    torch.manual_seed(0)
    model = acc.prepare(Net().to(acc.device))
    x = torch.randn(4, 16, device=acc.device)
    assert model(x)["hidden"].dtype == torch.float32
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x)["out"], model(x)["out"], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_error_while_the_compiled_graph_runs_leaves_no_autocast_behind(backend: str) -> None:
    """The hooks inlined into the graph: an index error raised by a kernel mid-graph."""
    torch._dynamo.reset()
    acc = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = acc.prepare(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)).to(acc.device))
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    good = torch.tensor([1, 2], device=acc.device)
    expected = compiled(good)
    with pytest.raises(IndexError):
        compiled(torch.tensor([1, 20], device=acc.device))
    assert not _autocast_on(acc.device)
    assert torch.equal(compiled(good), expected) and torch.equal(model(good), expected)


class Breaking(nn.Module):
    """A graph break between the layers (without fullgraph, dynamo splits forward in two)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.relu(hidden))


@pytest.mark.parametrize("inlined", [True, False])
def test_a_graph_break_inside_a_prepared_fp16_forward_keeps_eager_numbers(inlined: bool) -> None:
    """fp16 is not CPU autocast's default dtype: the traced dtype change must survive the break."""
    torch._dynamo.reset()
    acc = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = Breaking().to(acc.device)
    reference = copy.deepcopy(model)
    prepared = acc.prepare(model)
    x = torch.randn(4, 16, device=acc.device)
    expected = _eager_autocast(reference, x, "fp16").float()
    if inlined:  # the hooks traced (inlined in the caller's frame), the break between them
        out = torch.compile(Caller(prepared), backend="aot_eager")(x) / 2
    else:
        out = torch.compile(prepared, backend="aot_eager")(x)
    assert torch.equal(out, expected) and not _autocast_on(acc.device)
