"""Models and optimizers of a checkpoint as DeepSpeed engine checkpoints.

Strategies whose ``checkpoint_format`` is "deepspeed" store each engine with
``engine.save_checkpoint(<checkpoint>/deepspeed, tag="model_<i>")`` inside the checkpoint's
temporary folder: every process writes its ZeRO partition, then fsyncs what it wrote, before
the manifest is written and the folder renamed (so a crash mid-save leaves the previous
checkpoint as the newest complete one). The manifest entry records the ZeRO stage, the number
of processes and each parameter's name and full shape: ``load_state`` compares them with the
live engine on every process before anything is loaded. ZeRO partitions belong to the process
count that wrote them; another count is refused (consolidate the weights with
``hasten merge-weights`` or ``zero_to_fp32`` and start a new run from them).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

from torch import nn

SUBDIR = "deepspeed"
KEY = "deepspeed"


def _shapes(module: nn.Module) -> dict[str, list[int]]:
    """Full shapes of the parameters (ZeRO-3 keeps them in ``ds_shape``)."""
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


class DeepSpeedCheckpoint:
    """The checkpoint backend of a ``DeepSpeedStrategy`` (same interface as ``checkpointing.sharded``)."""

    KEY = KEY

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def refuse(self, blocking: bool, mid_window: bool) -> None:
        if not blocking:
            raise ValueError("save_state(blocking=False) is not available under DeepSpeed; call save_state() "
                             "without blocking=False")
        if mid_window:
            raise ValueError("save_state inside a gradient-accumulation window: DeepSpeed keeps the partial "
                             "gradients in its own buffers, which a checkpoint cannot hold; save where "
                             "accelerator.sync_gradients is True")

    def _engines(self, inner: list[nn.Module]) -> list[Any]:
        engines = [self.strategy.engine_of(m) for m in inner]
        if any(e is None for e in engines):
            names = [type(m).__name__ for m, e in zip(inner, engines) if e is None]
            raise ValueError(f"save_state under DeepSpeed: models {names} have no DeepSpeed engine (prepared without "
                             "an optimizer); prepare only trained models, or save those with save_model")
        return engines

    def entries(self, inner: list[nn.Module], optimizers: list[Any]) -> tuple[list[dict], list[bool]]:
        self._engines(inner)
        world = self.strategy.state.num_processes
        stage = self.strategy.plugin.zero_stage_value
        models = [{KEY: f"model_{i}", "zero_stage": stage, "world_size": world, "shapes": _shapes(m)}
                  for i, m in enumerate(inner)]
        return models, [True] * len(optimizers)

    @staticmethod
    def optimizer_entry(index: int, with_state: bool) -> Optional[str]:
        return "engine"  # inside the engine checkpoint of its model

    def writer(self, acc: Any, folder: str, inner: list[nn.Module], with_state: list[bool], group: Any) -> Any:
        return functools.partial(self.save, folder, inner)

    def save(self, folder: str, inner: list[nn.Module]) -> None:
        """Every process writes its partitions, then makes the files it can see durable."""
        from .fileio import fsync_path

        path = os.path.join(folder, SUBDIR)
        os.makedirs(path, exist_ok=True)
        for i, engine in enumerate(self._engines(inner)):
            engine.save_checkpoint(path, tag=f"model_{i}", save_latest=False)
        rank = self.strategy.state.process_index
        for root, _, names in os.walk(path):
            for name in names:
                # Each process fsyncs its own partition files; process 0 the shared ones.
                if f"rank_{rank}_" in name or (rank == 0 and "zero_pp_rank_" not in name):
                    fsync_path(os.path.join(root, name))
            fsync_path(root)

    @staticmethod
    def listing(folder: str) -> dict[str, dict[str, Any]]:
        out = {}
        base = os.path.join(folder, SUBDIR)
        for root, _, names in os.walk(base):
            for name in sorted(names):
                full = os.path.join(root, name)
                out[os.path.relpath(full, folder)] = {"size": os.path.getsize(full), "checksum": None, "rank": KEY}
        return out

    def check(self, folder: str, contents: dict[str, Any], inner: list[nn.Module], optimizers: list[Any]) -> list[str]:
        """Differences between the stored engines and the live ones (reads only)."""
        problems = []
        try:
            self._engines(inner)
        except ValueError as e:
            return [str(e)]
        world = self.strategy.state.num_processes
        stage = self.strategy.plugin.zero_stage_value
        for i, (entry, module) in enumerate(zip(contents["models"], inner)):
            if entry.get("world_size") != world:
                problems.append(f"model {i} was saved by DeepSpeed on {entry.get('world_size')} processes and this run "
                                f"has {world}; ZeRO partitions only load on the same number of processes: resume with "
                                f"{entry.get('world_size')}, or consolidate the weights (hasten merge-weights) and start "
                                "from them")
            if entry.get("zero_stage") != stage:
                problems.append(f"model {i} was saved with ZeRO stage {entry.get('zero_stage')} and this run uses "
                                f"stage {stage}; resume with zero_stage={entry.get('zero_stage')}")
            live, saved = _shapes(module), entry.get("shapes", {})
            wrong = [f"{k} (checkpoint {saved.get(k)}, model {v})" for k, v in live.items() if saved.get(k) != v]
            extra = [k for k in saved if k not in live]
            if wrong or extra:
                problems.append(f"model {i} ({type(module).__name__}): parameters differ: "
                                f"{', '.join((wrong + extra)[:8])}")
            if not os.path.isdir(os.path.join(folder, SUBDIR, entry[KEY])):
                problems.append(f"model {i}: the engine checkpoint folder {SUBDIR}/{entry[KEY]} is missing")
        return problems

    def load(self, folder: str, contents: dict[str, Any], inner: list[nn.Module], optimizers: list[Any]) -> None:
        path = os.path.join(folder, SUBDIR)
        for i, engine in enumerate(self._engines(inner)):
            loaded, _ = engine.load_checkpoint(path, tag=f"model_{i}")
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load {path}/model_{i}")


def backend_for(strategy: Any) -> Any:
    """The checkpoint backend of ``strategy``: None (full files), the DCP module, or a DeepSpeed one."""
    fmt = strategy.checkpoint_format
    if fmt == "deepspeed":
        return DeepSpeedCheckpoint(strategy)
    if fmt == "dcp":
        from . import sharded

        return sharded
    return None


def saved_backend(contents: dict[str, Any], strategy: Any) -> Any:
    """The backend that reads a checkpoint's models, from its manifest entries."""
    if any(KEY in e for e in contents["models"]):
        return DeepSpeedCheckpoint(strategy)
    if any("dcp" in e for e in contents["models"]):
        from . import sharded

        return sharded
    return None
