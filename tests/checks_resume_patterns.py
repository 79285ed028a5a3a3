"""Mid-epoch resume the way scripts written for Accelerate do it (run in each rank; see
test_resume_patterns.py).

A run trains ``EPOCHS`` epochs of a model with dropout on a shuffled loader whose dataset and
collate draw random numbers (torch's and Python's global generators), saving after step
``SAVE_AT[world size]`` (mid-epoch, in epoch 1). A resumed run, in a new Accelerator, loads that
checkpoint after ``set_seed`` and trains to the end with one of the patterns:

- ``skip_loop``: its own ``continue`` over the first ``resume_step`` batches (diffusers' examples);
- ``skip_first_batches``: ``accelerator.skip_first_batches(loader, resume_step)`` for the interrupted
  epoch, ``loader`` for the later ones (transformers' no_trainer scripts);
- ``stateful``: ``DataLoaderConfiguration(use_stateful_dataloader=True)``, the loader iterated as is;
- ``no_skip``: no skipping at all (the interrupted epoch starts again);
- ``continue_option``: hasten's ``load_state(..., continue_dataloaders=True)``, iterated as is;
- ``resume_folder``: hasten's ``Accelerator(resume=<folder>)``, iterated as is.

Each check returns the steps it trained (epoch, samples of the batch on this rank) and its final
weights next to the uninterrupted run's. ``check_accelerate_*`` run the same script with Accelerate
(one process) for comparison.
"""

from __future__ import annotations

import functools
import os
import random
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

N, FEATURES, BATCH, EPOCHS = 40, 4, 4, 3
SAVE_AT = {1: 13, 2: 7}  # optimizer steps: 1 process: epoch 1, batch 3 of 10; 2 processes: batch 2 of 5


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class Data(Dataset):
    """Fixed samples plus noise from the global torch generator, drawn when a sample is read."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = torch.randn(N, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(FEATURES), self.y[i], i


def collate(items):
    """Stacks the samples and scales them by a draw from Python's global generator."""
    xs, ys, ids = zip(*items)
    return torch.stack(xs) * (1.0 + 0.05 * random.random()), torch.stack(ys), torch.tensor(ids)


def _reset(lib: str) -> None:
    if lib == "hasten":
        from distributed import reset_state

        reset_state()
    else:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def build(lib: str = "hasten", shuffle: bool = True, stateful: bool = False, resume=None, workers: int = 0,
          accum: int = 1):
    """Accelerator, model, optimizer and loader as a script builds them (``set_seed`` first)."""
    _reset(lib)
    if lib == "hasten":
        from hasten import Accelerator
        from hasten.utils import DataLoaderConfiguration, set_seed
    else:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed
    torch.manual_seed(999)  # whatever a new process holds: set_seed and load_state decide
    random.seed(999)
    set_seed(0)
    kwargs = {"resume": resume} if resume is not None else {}
    if accum > 1:
        kwargs["gradient_accumulation_steps"] = accum
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful), **kwargs)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DataLoader(Data(), batch_size=BATCH, shuffle=shuffle, collate_fn=collate, num_workers=workers)
    model, opt, dl = acc.prepare(model, opt, dl)
    return acc, model, opt, dl


def train(acc, model, opt, dl, pattern: str = "plain", done: int = 0, save_to=None) -> dict:
    """Train to the end of ``EPOCHS``; ``done``: optimizer steps the checkpoint holds (0: a fresh run)."""
    steps_per_epoch = len(dl)
    first_epoch, resume_step = divmod(done, steps_per_epoch)
    resumed = done > 0
    seen, step_count = [], done
    for epoch in range(first_epoch, EPOCHS):
        active = dl
        if pattern == "skip_first_batches" and resumed and epoch == first_epoch and resume_step:
            active = acc.skip_first_batches(dl, resume_step)
        for step, (x, y, ids) in enumerate(active):
            if pattern == "skip_loop" and resumed and epoch == first_epoch and step < resume_step:
                continue
            with acc.accumulate(model):
                loss = ((model(x) - y) ** 2).mean()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            step_count += 1
            seen.append([epoch, ids.tolist()])
            if save_to is not None and step_count == SAVE_AT[world()]:
                acc.save_state(save_to)
    acc.wait_for_everyone()
    weights = {k: v.detach().cpu().flatten().tolist() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {"seen": seen, "steps": step_count - done, "weights": weights, "steps_per_epoch": steps_per_epoch}


def _folder(lib: str, shuffle: bool, workers: int = 0, accum: int = 1) -> str:
    return os.path.join(os.environ["HASTEN_TEST_TMP"],
                        f"{lib}-{'shuffled' if shuffle else 'ordered'}-{workers}-{accum}")


_RUNS: dict = {}


def uninterrupted(lib: str = "hasten", shuffle: bool = True, workers: int = 0, accum: int = 1) -> dict:
    """The run that was not interrupted (it saves at ``SAVE_AT`` on the way), once per process."""
    key = (lib, shuffle, workers, accum)
    if key not in _RUNS:
        folder = _folder(lib, shuffle, workers, accum)
        _RUNS[key] = train(*build(lib, shuffle, workers=workers, accum=accum), save_to=folder)
    return _RUNS[key]


def resumed(pattern: str, lib: str = "hasten", shuffle: bool = True, workers: int = 0, accum: int = 1) -> dict:
    whole = uninterrupted(lib, shuffle, workers, accum)
    folder = _folder(lib, shuffle, workers, accum)
    if pattern == "resume_folder":
        parts = build(lib, shuffle, resume=folder, workers=workers, accum=accum)  # prepare restores it
    else:
        parts = build(lib, shuffle, stateful=pattern == "stateful", workers=workers, accum=accum)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if pattern == "continue_option":
                parts[0].load_state(folder, continue_dataloaders=True)
            else:
                parts[0].load_state(folder)
    loop = "plain" if pattern in ("stateful", "continue_option", "resume_folder", "no_skip") else pattern
    out = train(*parts, pattern=loop, done=SAVE_AT[world()])
    out["load_warnings"] = [str(w.message) for w in caught] if pattern != "resume_folder" else []
    return {"whole": whole, "resumed": out}


PATTERNS = ("skip_loop", "skip_first_batches", "stateful", "no_skip", "continue_option", "resume_folder")
for _pattern in PATTERNS:  # check_skip_loop, check_skip_first_batches, ...: one check per pattern
    globals()[f"check_{_pattern}"] = functools.partial(resumed, _pattern)


def check_hasten_ordered():
    """Unshuffled loader, one process: the batches Accelerate's run sees (compared in the test)."""
    if world() != 1:
        return None
    return {p: resumed(p, shuffle=False) for p in ("skip_loop", "skip_first_batches", "no_skip")}


def _accelerate(shuffle: bool):
    if world() != 1 and not shuffle:
        return None
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return "not installed"
    return {p: resumed(p, lib="accelerate", shuffle=shuffle) for p in ("skip_loop", "skip_first_batches", "no_skip")}


def check_accelerate_ordered():
    return _accelerate(shuffle=False)


def check_accelerate_shuffled():
    return _accelerate(shuffle=True)


def check_skip_loop_workers():
    """Two worker processes read the data (one process): their draws are replayed with the epoch."""
    return resumed("skip_loop", workers=2) if world() == 1 else None


def check_skip_loop_accumulation():
    """``accumulate`` with 2 micro-steps, saved inside a window (odd ``SAVE_AT``, as diffusers' loops
    skip in batches): the skipped batches leave the restored step counter and partial gradients alone."""
    return resumed("skip_loop", accum=2)


def check_saved_again_before_iterating():
    """A resumed run that saves before its loop ever ran (and ends there); the run resumed from that
    second checkpoint skips in its own loop and must still equal the uninterrupted run."""
    whole = uninterrupted()
    again = _folder("hasten", True) + "-again"
    acc = build()[0]
    acc.load_state(_folder("hasten", True))
    acc.save_state(again)
    acc.wait_for_everyone()
    parts = build()
    parts[0].load_state(again)
    return {"whole": whole, "resumed": train(*parts, pattern="skip_loop", done=SAVE_AT[world()])}
