"""Models and optimizers of a checkpoint as DeepSpeed engine checkpoints.

The DeepSpeed strategy's checkpoint backend stores each engine with
``engine.save_checkpoint(<checkpoint>/deepspeed, tag="model_<i>")`` inside the checkpoint's
temporary folder: every process writes its ZeRO partition, then fsyncs what it wrote, before
the manifest is written and the folder renamed (so a crash mid-save leaves the previous
checkpoint as the newest complete one). The manifest entry records the ZeRO stage, the number
of processes and each parameter's name and full shape: ``load_state`` compares them with the
live model on every process before anything is loaded.

Loading: a DeepSpeed run with the same number of processes and the same stage loads the engine
checkpoint with DeepSpeed (exact, optimizer included). Any other run (another process count,
another stage, DDP, one process, FSDP2) loads the consolidated fp32 weights
(``consolidated_weights``, DeepSpeed's ``zero_to_fp32`` reading the partitions in each process)
and starts its optimizers fresh, with a warning saying so: ZeRO partitions the optimizer state
by flat buffers tied to the process count that wrote them.

DeepSpeed unpickles its files with ``weights_only=False``; every process first reads them with
hasten's allow-list (``refuse_foreign_pickles``), so a replaced file is refused before it can run.
Each process checksums the files it wrote, for ``load_state(verify="checksum")``.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import os
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

SUBDIR = "deepspeed"
KEY = "deepspeed"


def _shapes(module: nn.Module) -> dict[str, list[int]]:
    """Full shapes of the parameters (ZeRO-3 keeps them in ``ds_shape``)."""
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


class DeepSpeedCheckpoint:
    """The checkpoint backend of engine checkpoints (same interface as ``checkpointing.sharded``).

    The DeepSpeed strategy builds it bound to its engines (``engine_of``: the engine of a prepared
    model) and its ZeRO stage; any other run reads a DeepSpeed checkpoint through one built by
    ``for_reading`` (no engines: it loads the consolidated weights). Either way this module needs
    nothing of the strategy's class.

    Args:
        state: the live process state (number of processes, this process's index).
        load_weights: ``(model, state_dict, strict)`` loading full weights into a prepared model.
        engine_of: the engine of a model (None: this run trains no engines).
        zero_stage: this run's ZeRO stage (None without DeepSpeed).
        run: what this run is, for messages when it trains no engines (its strategy's name).
    """

    KEY = KEY
    NAME = "DeepSpeed"
    EXCLUSIVE = True  # engines restore only from engine checkpoints (their optimizer lives in them)

    def __init__(self, state: Any, load_weights: Callable[..., Any], engine_of: Optional[Callable[[nn.Module], Any]] = None,
                 zero_stage: Optional[int] = None, run: str = "DeepSpeed") -> None:
        self.state = state
        self.load_weights = load_weights
        self.engine_of = engine_of
        self.zero_stage = zero_stage
        self.run = run

    @classmethod
    def for_reading(cls, strategy: Any) -> "DeepSpeedCheckpoint":
        """The reader of a DeepSpeed checkpoint for the live strategy: its own backend when it trains
        engines (bound to them), else one that loads the weights into plain models."""
        live = strategy.checkpoint_backend()
        if isinstance(live, cls):
            return live
        return cls(strategy.state, strategy.load_model_state_dict, run=type(strategy).__name__)

    def refuse(self, blocking: bool, mid_window: bool) -> None:
        if not blocking:
            raise ValueError("save_state(blocking=False) is not available under DeepSpeed; call save_state() "
                             "without blocking=False")
        if mid_window:
            raise ValueError("save_state inside a gradient-accumulation window: DeepSpeed keeps the partial "
                             "gradients in its own buffers, which a checkpoint cannot hold; save where "
                             "accelerator.sync_gradients is True")

    def _engines(self, inner: list[nn.Module]) -> list[Any]:
        engines = [self.engine_of(m) if self.engine_of is not None else None for m in inner]
        if any(e is None for e in engines):
            names = [type(m).__name__ for m, e in zip(inner, engines) if e is None]
            raise ValueError(f"save_state under DeepSpeed: models {names} have no DeepSpeed engine (prepared without "
                             "an optimizer); prepare only trained models, or save those with save_model")
        return engines

    def entries(self, inner: list[nn.Module], optimizers: list[Any]) -> tuple[list[dict], list[bool]]:
        self._engines(inner)
        world = self.state.num_processes
        stage = self.zero_stage
        models = [{KEY: f"model_{i}", "zero_stage": stage, "world_size": world, "shapes": _shapes(m)}
                  for i, m in enumerate(inner)]
        return models, [True] * len(optimizers)

    @staticmethod
    def optimizer_entry(index: int, with_state: bool) -> Optional[str]:
        return "engine"  # inside the engine checkpoint of its model

    def writer(self, acc: Any, folder: str, inner: list[nn.Module], with_state: list[bool], group: Any) -> Any:
        return functools.partial(self.save, folder, inner)

    def save(self, folder: str, inner: list[nn.Module]) -> dict[str, str]:
        """Every process writes its partitions, then makes the files it can see durable; returns the
        checksums of its own files (``{manifest name: checksum}``) for the manifest."""
        from .fileio import file_checksum
        from ..saving import fsync_path

        path = os.path.join(folder, SUBDIR)
        os.makedirs(path, exist_ok=True)
        for i, engine in enumerate(self._engines(inner)):
            engine.save_checkpoint(path, tag=f"model_{i}", save_latest=False)
        rank = self.state.process_index
        checksums = {}
        for root, _, names in os.walk(path):
            for name in names:
                # Each process fsyncs its own partition files; process 0 the shared ones.
                if f"rank_{rank}_" in name or (rank == 0 and "zero_pp_rank_" not in name):
                    full = os.path.join(root, name)
                    fsync_path(full)
                    checksums[os.path.relpath(full, folder)] = file_checksum(full)
            fsync_path(root)
        return checksums

    @staticmethod
    def listing(folder: str) -> dict[str, dict[str, Any]]:
        out = {}
        base = os.path.join(folder, SUBDIR)
        for root, _, names in os.walk(base):
            for name in sorted(names):
                full = os.path.join(root, name)
                out[os.path.relpath(full, folder)] = {"size": os.path.getsize(full), "checksum": None, "rank": KEY}
        return out

    def _native(self, contents: dict[str, Any]) -> bool:
        """Whether DeepSpeed itself can load it: a DeepSpeed run with the stage and process count that wrote it."""
        if self.engine_of is None:
            return False
        world, stage = self.state.num_processes, self.zero_stage
        return all(e.get("world_size") == world and e.get("zero_stage") == stage for e in contents["models"])

    def _this_run(self) -> str:
        kind = f"ZeRO stage {self.zero_stage}" if self.zero_stage is not None else self.run
        return f"{kind} on {self.state.num_processes} process(es)"

    def check(self, folder: str, contents: dict[str, Any], inner: list[nn.Module], optimizers: list[Any]) -> list[str]:
        """Differences between the stored engines and the live models; reads the consolidated weights
        when DeepSpeed cannot load the partitions itself (reads only, changes nothing)."""
        if self.engine_of is not None:
            try:
                self._engines(inner)
            except ValueError as e:
                return [str(e)]
        self.native = self._native(contents)
        self.weights: list[dict[str, torch.Tensor]] = []
        self.groups: list[Optional[list[dict[str, Any]]]] = []  # per engine: its optimizer's hyperparameters
        problems = []
        for i, (entry, module) in enumerate(zip(contents["models"], inner)):
            label = f"model {i} ({type(module).__name__}, saved by ZeRO stage {entry.get('zero_stage')} on " \
                    f"{entry.get('world_size')} processes, this run {self._this_run()})"
            live, saved = _shapes(module), entry.get("shapes", {})
            wrong = [f"{k} (checkpoint {saved.get(k)}, model {v})" for k, v in live.items() if saved.get(k) != v]
            extra = [k for k in saved if k not in live]
            if wrong or extra:
                problems.append(f"{label}: parameters differ: {', '.join((wrong + extra)[:8])}")
            path = os.path.join(folder, SUBDIR, entry[KEY])
            if not os.path.isdir(path):
                problems.append(f"model {i}: the engine checkpoint folder {SUBDIR}/{entry[KEY]} is missing")
                continue
            refuse_foreign_pickles(path)  # raises: the files DeepSpeed would unpickle name nothing foreign
            if not self.native and not problems:
                try:
                    weights = consolidated_weights(path)
                    groups = saved_hyperparameters(path)
                except ValueError as e:
                    problems.append(f"{label}: {e}")
                    continue
                missing = sorted(set(module.state_dict()) - set(weights))
                if missing:
                    problems.append(f"{label}: the consolidated weights lack {', '.join(missing[:8])}")
                self.weights.append(weights)
                self.groups.append(groups)
        if not self.native and not problems:
            problems.extend(self._check_groups(inner, optimizers))
        return problems

    def _owned(self, inner: list[nn.Module], optimizers: list[Any]) -> list[tuple[Any, Optional[list[dict]]]]:
        """(optimizer, the saved hyperparameters of the engine of its model) for each live optimizer."""
        out = []
        for i, opt in enumerate(optimizers):
            inner_opt = getattr(opt, "optimizer", opt)
            held = {id(p) for g in inner_opt.param_groups for p in g["params"]}
            index = next((m for m, module in enumerate(inner) if any(id(p) in held for p in module.parameters())
                          or getattr(self._engine(module), "optimizer", None) is inner_opt), i)
            out.append((inner_opt, self.groups[index] if index < len(self.groups) else None))
        return out

    def _engine(self, module: nn.Module) -> Any:
        return self.engine_of(module) if self.engine_of is not None else None

    def _check_groups(self, inner: list[nn.Module], optimizers: list[Any]) -> list[str]:
        problems = []
        for i, (opt, groups) in enumerate(self._owned(inner, optimizers)):
            if groups is not None and len(groups) != len(opt.param_groups):
                problems.append(f"optimizer {i}: {len(groups)} parameter groups saved, {len(opt.param_groups)} in "
                                "this run")
        return problems

    def load(self, folder: str, contents: dict[str, Any], inner: list[nn.Module], optimizers: list[Any]) -> None:
        if not self.native:
            for module, weights in zip(inner, self.weights):
                self.load_weights(module, weights, strict=False)
            for opt, groups in self._owned(inner, optimizers):
                for live, stored in zip(opt.param_groups, groups or []):
                    # The learning rate a scheduler set goes with the scheduler's state. Keys this run's
                    # optimizer lacks, and how a step runs on the writer's machine (fused, foreach...), stay.
                    live.update({k: v for k, v in stored.items() if k in live and k not in _HOW_TO_STEP})
            entry = contents["models"][0] if contents["models"] else {}
            warnings.warn(
                f"load_state: the DeepSpeed checkpoint was written by ZeRO stage {entry.get('zero_stage')} on "
                f"{entry.get('world_size')} processes and this run is {self._this_run()}: the consolidated fp32 "
                "weights were loaded, the optimizer state (moments, step counts, fp16 loss scale) was not restored "
                "and the optimizers start fresh (with the saved hyperparameters, learning rate included); "
                "schedulers, data positions, RNG and registered objects were restored",
                stacklevel=4)
            self.weights, self.groups = [], []
            return
        path = os.path.join(folder, SUBDIR)
        for i, engine in enumerate(self._engines(inner)):
            loaded, _ = engine.load_checkpoint(path, tag=f"model_{i}")
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load {path}/model_{i}")


# DeepSpeed's checkpoint files are pickles holding tensors, dicts and these plain records.
_RECORDS = (("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
            ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
            ("deepspeed.utils.tensor_fragment", "fragment_address"))
_KIND = "DeepSpeed checkpoint"


def refuse_foreign_pickles(path: str) -> None:
    """Read every pickle of the engine checkpoint folder ``path`` with hasten's allow-list (tensors,
    plain containers, DeepSpeed's records; the tensor data is mapped, not read), raising
    ``unpickling.ForbiddenPickle`` for a file that names anything else. DeepSpeed's own readers
    (``load_checkpoint``, ``zero_to_fp32``) pass ``weights_only=False``; they are given only folders
    that passed, so nothing in a replaced file runs. Changes no process-wide setting."""
    from . import unpickling

    for name in sorted(glob.glob(os.path.join(glob.escape(path), "*.pt"))):
        unpickling.torch_file(name, _KIND, _RECORDS, mmap=True)


def is_engine_checkpoint(path: str) -> bool:
    """Whether ``path`` is one engine checkpoint folder (``<save dir>/<tag>``)."""
    return os.path.isdir(path) and bool(glob.glob(os.path.join(glob.escape(path), "*model_states.pt")))


def consolidated_weights(path: str) -> dict[str, torch.Tensor]:
    """The full fp32 weights of the engine checkpoint folder ``path`` (``<save dir>/<tag>``), rebuilt
    from every process's ZeRO partitions in this process alone (no process group, no engine).
    Raises ``ValueError`` with one line naming what is missing or damaged."""
    if not is_engine_checkpoint(path):
        raise ValueError(f"{path!r} holds no DeepSpeed model states (*model_states.pt); pass an engine checkpoint "
                         "folder (the folder save_checkpoint wrote for one tag)")
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError:
        raise ValueError("reading a DeepSpeed checkpoint needs DeepSpeed: pip install 'hasten[deepspeed]' (on CPU "
                         "with DS_BUILD_OPS=0)") from None
    from .unpickling import ForbiddenPickle

    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            refuse_foreign_pickles(path)
            if not glob.glob(os.path.join(glob.escape(path), "*optim_states.pt")):
                return _stage0_weights(path)
            parent, tag = os.path.split(os.path.normpath(path))
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
    except ForbiddenPickle as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - missing partitions, truncated files
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        raise ValueError(f"cannot rebuild the weights of the DeepSpeed checkpoint {path!r} ({type(e).__name__}: "
                         f"{lines[0] if lines else 'no message'}); it is incomplete or damaged") from None
    return {k: v.detach() for k, v in state.items()}


_HOW_TO_STEP = ("foreach", "fused", "capturable", "differentiable")


def saved_hyperparameters(path: str) -> Optional[list[dict[str, Any]]]:
    """The hyperparameters of each parameter group (learning rate, momentum, ...) of the optimizer in
    the engine checkpoint folder ``path``, from process 0's files; None when they hold no optimizer."""
    from . import unpickling

    optim = sorted(glob.glob(os.path.join(glob.escape(path), "*optim_states.pt")))
    model = sorted(glob.glob(os.path.join(glob.escape(path), "*model_states.pt")))
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            if optim:  # ZeRO 1/2 (and bf16): "base_optimizer_state"; ZeRO 3: "optimizer_state_dict"
                wrapper = unpickling.torch_file(optim[0], _KIND, _RECORDS).get("optimizer_state_dict") or {}
                base = wrapper.get("base_optimizer_state") or wrapper.get("optimizer_state_dict")
            else:  # no ZeRO: the torch optimizer's state dict beside the module
                base = unpickling.torch_file(model[0], _KIND, _RECORDS).get("optimizer") if model else None
    except Exception as e:  # noqa: BLE001 - truncated files, foreign pickles
        raise ValueError(f"cannot read the optimizer hyperparameters of the DeepSpeed checkpoint {path!r} "
                         f"({type(e).__name__}); it is incomplete or damaged") from None
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(groups, list):
        return None
    return [{k: v for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]


def _stage0_weights(path: str) -> dict[str, torch.Tensor]:
    """Without ZeRO (stage 0) the model states file holds the whole module."""
    from . import unpickling

    files = sorted(glob.glob(os.path.join(glob.escape(path), "*model_states.pt")))
    module = unpickling.torch_file(files[0], _KIND, _RECORDS)["module"]
    return {k: v for k, v in module.items() if isinstance(v, torch.Tensor)}


from .backends import register  # noqa: E402

register(KEY, DeepSpeedCheckpoint.for_reading)
