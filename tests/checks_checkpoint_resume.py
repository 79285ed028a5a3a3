"""Exact resume, run inside each rank (see distributed.py and test_checkpoint_resume.py).

Phase ``save`` (env CKPT_PHASE) trains every scenario to the end, saving one checkpoint on the way;
phase ``resume`` runs in *new* processes, loads that checkpoint and trains to the end. The test
compares losses and final weights bitwise. ``check_cross_world_size`` resumes the other world
size's checkpoints (2 -> 1 and 1 -> 2).
"""

import os
from typing import Optional

import torch
from torch import nn

from hasten import Accelerator
from hasten.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

N, FEATURES, BATCH, EPOCHS = 48, 6, 4, 2
N_STREAM = 46  # not a multiple of the batch size: the end of an epoch is padded on 2 processes

# save points (micro-steps per process) for 1 and 2 processes
SCENARIOS = {
    "mid_epoch": dict(accum=1, workers=0, augment=True, save_at={1: 4, 2: 3}),
    "mid_accum": dict(accum=3, workers=0, augment=True, save_at={1: 7, 2: 4}),
    "workers": dict(accum=2, workers=2, augment=False, save_at={1: 9, 2: 8}),
    "epoch_end": dict(accum=1, workers=0, augment=True, save_at={1: 12, 2: 6}),
    # iterable datasets with their own state_dict: process 0 reads and dispatches (the default) ...
    "stream_dispatch": dict(accum=1, workers=0, augment=True, save_at={1: 5, 2: 3}, stream=True, dispatch=True),
    # ... or every process reads the stream and keeps its slice
    "stream_shards": dict(accum=2, workers=0, augment=True, save_at={1: 5, 2: 3}, stream=True, dispatch=False),
    # save_state(blocking=False) inside an accumulation window: training changes the state while the
    # files are written (and, on 2 processes, all-reduces while the save exchanges its file lists)
    "background": dict(accum=3, workers=0, augment=True, save_at={1: 7, 2: 4}, blocking=False),
}
# The process seed differs from the resumed run's (no set_seed, or another one) / the order is drawn
# from the user's own generator: the saved order must be kept, on any number of processes.
SCENARIOS["other_seed"] = dict(SCENARIOS["mid_epoch"], seed=77)
SCENARIOS["user_generator"] = dict(SCENARIOS["mid_epoch"], generator=True)
# The loop leaves early (a time or step budget: `break`), then saves and the script ends; the
# resumed run must continue as the scenario it mirrors did without a break.
for _name in ("mid_epoch", "workers"):
    SCENARIOS[f"break_{_name}"] = dict(SCENARIOS[_name], mirrors=_name, break_to_save=True)
STREAM: list = []  # the Stream of the running scenario


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset that resumes through its own state (like HF ``datasets.IterableDataset``):
    a shuffled order per epoch; ``reads[epoch]`` counts the samples read."""

    def __init__(self, augment: bool) -> None:
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(N_STREAM, FEATURES, generator=g)
        self.y = torch.randn(N_STREAM, 1, generator=g)
        self.augment, self.epoch, self.pos = augment, 0, 0
        self.start: dict = {}
        self.reads: dict = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.start = dict(state)

    def __iter__(self):
        order = torch.randperm(N_STREAM, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        start = self.start.get("pos", 0) if self.start.get("epoch") == self.epoch else 0
        self.start = {}
        for self.pos in range(start + 1, N_STREAM + 1):
            i = order[self.pos - 1]
            self.reads[self.epoch] = self.reads.get(self.epoch, 0) + 1
            x = self.x[i] + 0.1 * torch.randn(FEATURES) if self.augment else self.x[i]
            yield x, self.y[i], i


class Data(torch.utils.data.Dataset):
    """Fixed samples; ``augment`` adds noise from the global torch RNG when a sample is read."""

    def __init__(self, augment: bool) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = torch.randn(N, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.randn(FEATURES)
        return x, self.y[i], i


class Progress:
    """A registered object: the number of micro-steps done."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def project(name: str, ws: int) -> str:
    return os.path.join(os.environ["CKPT_ROOT"], f"ws{ws}", name)


def build(name: str, ws: int):
    cfg = SCENARIOS[name]
    set_seed(cfg.get("seed", 0) if os.environ["CKPT_PHASE"] == "save" else 0)
    acc = Accelerator(gradient_accumulation_steps=cfg["accum"],
                      project_config=ProjectConfiguration(project(name, ws), automatic_checkpoint_naming=True),
                      dataloader_config=DataLoaderConfiguration(dispatch_batches=cfg.get("dispatch")))
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    if cfg.get("stream"):
        STREAM[:] = [Stream(cfg["augment"])]
        dl = torch.utils.data.DataLoader(STREAM[0], batch_size=BATCH)
    else:
        generator = torch.Generator().manual_seed(5) if cfg.get("generator") else None
        dl = torch.utils.data.DataLoader(Data(cfg["augment"]), batch_size=BATCH, shuffle=True,
                                         num_workers=cfg["workers"], generator=generator)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    return acc, model, opt, dl, sched, progress


def train(acc, model, opt, dl, sched, progress, save_at=None, stop_epoch=EPOCHS, blocking=True,
          break_to_save=False):
    losses, seen = {}, {}
    for epoch in range(dl.iteration, stop_epoch):
        for x, y, idx in dl:
            with acc.accumulate(model):
                loss = ((model(x) - y) ** 2).mean()
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            progress.steps += 1
            losses[progress.steps] = loss.item()
            seen[progress.steps] = (epoch, idx.tolist())
            if progress.steps == save_at:
                if break_to_save:
                    break
                acc.save_state(blocking=blocking)
        if break_to_save and progress.steps == save_at:
            acc.save_state(blocking=blocking)  # after leaving the loop early; the script ends here
            break
    weights = {k: v.tolist() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {"losses": losses, "seen": seen, "weights": weights}


def scenario(name: str):
    ws = world()
    parts = build(name, ws)
    acc = parts[0]
    if os.environ["CKPT_PHASE"] == "save":
        cfg = SCENARIOS[name]
        out = train(*parts, save_at=cfg["save_at"][ws], blocking=cfg.get("blocking", True),
                    break_to_save=cfg.get("break_to_save", False))
        acc.wait_for_checkpoint()
        out["checkpoints"] = sorted(os.listdir(os.path.join(project(name, ws), "checkpoints")))
        return out
    folder = acc.load_state(continue_dataloaders=True)  # hasten's positioning: the loop has no skipping code
    out = train(*parts)
    out["loaded"] = os.path.basename(folder)
    out["iteration"] = acc.project_configuration.iteration
    if STREAM:
        out["reads"] = STREAM[0].reads
    return out


def check_mid_epoch():
    return scenario("mid_epoch")


def check_mid_accum():
    return scenario("mid_accum")


def check_workers():
    return scenario("workers")


def check_epoch_end():
    return scenario("epoch_end")


def check_stream_dispatch():
    return scenario("stream_dispatch")


def check_stream_shards():
    return scenario("stream_shards")


def check_background():
    return scenario("background")


def check_break_mid_epoch():
    return scenario("break_mid_epoch")


def check_break_workers():
    return scenario("break_workers")


def check_saving_does_not_change_training():
    """The same run without any save ends with the same weights as the run that saved."""
    if os.environ["CKPT_PHASE"] != "save":
        return None
    parts = build("mid_accum", world())
    parts[0].project_configuration.project_dir = None  # no saving here
    return train(*parts)["weights"]


def _cross_world_size(name: str) -> Optional[dict]:
    """Resume the other world size's checkpoint of ``name`` and train to the end of its epoch;
    first check that a mid-accumulation checkpoint is refused."""
    if os.environ["CKPT_PHASE"] != "resume":
        return None
    import warnings

    from hasten.saving import CheckpointMismatchError

    ws = world()
    other = 2 if ws == 1 else 1
    acc, model, opt, dl, sched, progress = build(name, ws)
    before = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    refused = None
    try:
        acc.load_state(os.path.join(project("mid_accum", other), "checkpoints", "checkpoint_0"))
    except CheckpointMismatchError as e:
        refused = str(e)
    untouched = all(torch.equal(before[k], v) for k, v in acc.unwrap_model(model).state_dict().items())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(os.path.join(project(name, other), "checkpoints", "checkpoint_0"), continue_dataloaders=True)
    epoch = dl.iteration
    out = train(acc, model, opt, dl, sched, progress, stop_epoch=epoch + 1)
    return {"refused": refused, "untouched": untouched, "epoch": epoch, "seen": out["seen"],
            "warnings": [str(w.message) for w in caught]}


def check_cross_world_size():
    return _cross_world_size("mid_epoch")


def check_cross_world_size_other_seed():
    return _cross_world_size("other_seed")


def check_cross_world_size_user_generator():
    return _cross_world_size("user_generator")


def check_other_seed():
    return scenario("other_seed")


def check_user_generator():
    return scenario("user_generator")
