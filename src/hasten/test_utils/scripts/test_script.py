"""End-to-end checks of hasten on the processes it is started on, through the public API only.

    hasten launch --num_processes 2 --cpu path/to/test_script.py
    debug_launcher(test_script.main)              # from hasten.test_utils import test_script

Each check raises AssertionError (naming what differed) when hasten misbehaves; ``main`` runs them
all and prints one line per check on the main process. The checks: process state and execution
helpers, RNG synchronisation, dataloader sharding (per process and dispatched), exact
``gather_for_metrics``, ``split_between_processes``, triggers, and training equivalence: N processes
with batch B end with the same weights as one process with batch N*B.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from hasten import Accelerator, DataLoaderConfiguration, PartialState
from hasten.state import AcceleratorState, GradientState
from hasten.test_utils.testing import are_the_same_tensors
from hasten.test_utils.training import RegressionDataset, RegressionModel
from hasten.utils import gather_object, set_seed, synchronize_rng_states


def fresh_accelerator(**kwargs) -> Accelerator:
    """A new Accelerator with the given settings (the process group is kept)."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


def init_state_check() -> None:
    state = PartialState()
    assert 0 <= state.process_index < state.num_processes, state
    assert state.is_main_process == (state.process_index == 0)
    assert state.is_last_process == (state.process_index == state.num_processes - 1)
    assert state.use_distributed == (state.num_processes > 1)


def process_execution_check() -> None:
    state = PartialState()

    @state.on_main_process
    def only_main() -> int:
        return 1

    @state.on_last_process
    def only_last() -> int:
        return 1

    ran = [only_main() or 0, only_last() or 0]
    assert ran[0] == int(state.is_main_process), ran
    assert ran[1] == int(state.is_last_process), ran
    entered = []
    with state.main_process_first():
        entered.append(state.process_index)
    assert entered == [state.process_index]
    assert are_the_same_tensors(torch.tensor([state.num_processes]))


def rng_sync_check() -> None:
    state = PartialState()
    torch.manual_seed(1000 + state.process_index)
    synchronize_rng_states(["torch"])
    assert are_the_same_tensors(torch.rand(5)), "torch RNG differs between processes after synchronize_rng_states"
    generator = torch.Generator()
    generator.manual_seed(2000 + state.process_index)
    synchronize_rng_states(["generator"], generator=generator)
    assert are_the_same_tensors(torch.rand(5, generator=generator)), "generator differs between processes"


def _samples_seen(accelerator: Accelerator, loader: DataLoader) -> list[int]:
    mine = [int(v) for batch in loader for v in batch.tolist()]
    return sorted(v for part in gather_object([mine]) for v in part)


def dl_preparation_check() -> None:
    for dispatch in (False, True):
        for split in (False, True):
            acc = fresh_accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch,
                                                                              split_batches=split))
            n = acc.num_processes
            length = 8 * n * 3
            loader = acc.prepare(DataLoader(list(range(length)), batch_size=8 * (n if split else 1)))
            seen = _samples_seen(acc, loader)
            assert seen == list(range(length)), f"dispatch={dispatch} split={split}: samples seen {seen}"
            assert len(loader) == 3, f"dispatch={dispatch} split={split}: {len(loader)} batches per process, not 3"


def gather_for_metrics_check() -> None:
    acc = fresh_accelerator()
    length = 8 * acc.num_processes + 3  # not a whole number of global batches: padding must be dropped
    loader = acc.prepare(DataLoader(torch.arange(length, dtype=torch.float32), batch_size=4))
    gathered = torch.cat([acc.gather_for_metrics(batch) for batch in loader])
    assert gathered.tolist() == list(range(length)), f"gather_for_metrics gave {gathered.tolist()}"


def split_between_processes_check() -> None:
    state = PartialState()
    n, i = state.num_processes, state.process_index
    data = list(range(2 * n + 1))
    with state.split_between_processes(data) as part:
        parts = gather_object([part])
    assert [v for p in parts for v in p] == data, parts
    with state.split_between_processes({"a": data, "b": data}) as part:
        assert part["a"] == part["b"], part
    with state.split_between_processes(torch.arange(2 * n)) as part:
        assert part.tolist() == [2 * i, 2 * i + 1], part
    with state.split_between_processes(data, apply_padding=True) as part:
        assert len(part) == (len(data) + n - 1) // n, part


def trigger_check() -> None:
    acc = fresh_accelerator()
    assert acc.check_trigger() is False
    if acc.is_main_process:
        acc.set_trigger()
    assert acc.check_trigger() is True, "a trigger set on the main process was not seen everywhere"
    assert acc.check_trigger() is False, "check_trigger must reset the trigger"


def _train(model: torch.nn.Module, loader, optimizer, accelerator=None, epochs: int = 3) -> None:
    for _ in range(epochs):
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            if accelerator is None:
                loss.backward()
            else:
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def training_check() -> None:
    """N processes x batch B must end where one process with batch N*B ends."""
    dataset = RegressionDataset(length=96, seed=42)
    for split in (False, True):
        acc = fresh_accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split))
        n, batch = acc.num_processes, 8
        set_seed(42)
        reference = RegressionModel().to(acc.device)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_loader = [{k: v.to(acc.device) for k, v in b.items()}
                      for b in DataLoader(dataset, batch_size=batch * n)]
        _train(reference, ref_loader, ref_opt)

        set_seed(42)
        model = RegressionModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(dataset, batch_size=batch * n if split else batch)
        model, opt, loader = acc.prepare(model, opt, loader)
        _train(model, loader, opt, acc)
        got = acc.unwrap_model(model)
        for name in ("a", "b"):
            mine, want = getattr(got, name).detach(), getattr(reference, name).detach()
            assert torch.allclose(mine, want, rtol=1e-5, atol=1e-6), (
                f"split_batches={split}: {name}={mine.item()} after training on {n} process(es), "
                f"{want.item()} with one process and batch {batch * n}")
        assert are_the_same_tensors(got.a.detach()), "processes disagree on the trained weights"


def main() -> None:
    fresh_accelerator()  # are_the_same_tensors asks the accelerator's state, as in Accelerate
    state = PartialState()
    checks = [init_state_check, process_execution_check, rng_sync_check, dl_preparation_check,
              gather_for_metrics_check, split_between_processes_check, trigger_check, training_check]
    for check in checks:
        check()
        state.wait_for_everyone()
        state.print(f"{check.__name__}: ok on {state.num_processes} process(es)")


if __name__ == "__main__":
    main()
