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

DeepSpeed unpickles its files with ``weights_only=False``, and torch hands any TorchScript archive to
``torch.jit.load`` whatever the pickle module. hasten therefore reads each file once, checks its bytes
(torch.save's zip records only, or a legacy pickle) and unpickles them with its allow-list
(``refuse_foreign_pickles``), on every process for its own files, before DeepSpeed is called (every
process raises the same error). DeepSpeed is then given what was read (``checked_engine``), never the
files again; consolidation (``_consolidate``) reads each file once the same way and leaves only the
merging to DeepSpeed's ``zero_to_fp32``.
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

from ..files import unpickling
from ..files.durable import fsync_path
from ..files.errors import CheckpointCorruptError
from ..files.reading import file_checksum, read_path
from ..files.safetensors_format import SafetensorsView
from ..files.unpickling import ForbiddenPickle
# The private DeepSpeed interfaces this module uses, checked before use (re-exported: callers of old import them here)
from .deepspeed_api import DeepSpeedVersionError, check_engine_api, checkpoint_engine_class, version_error  # noqa: F401
from .deepspeed_api import zero_call as _zero_call

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
                 zero_stage: Optional[int] = None, run: str = "DeepSpeed",
                 weights_of: Optional[Callable[[nn.Module], dict]] = None,
                 settle: Optional[Callable[[str], None]] = None) -> None:
        self.state = state
        self.load_weights = load_weights
        self.engine_of = engine_of
        self.zero_stage = zero_stage
        self.run = run
        # The full weights of a model prepared without optimizer (every process calls it: ZeRO-3 gathers).
        self.weights_of = weights_of
        # The strategy's settling of a step held since the last backward (see DeepSpeedStrategy.settle).
        self.settle = settle

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
        if self.settle is not None:
            self.settle("save_state")  # refused between backward and the loop's own optimizer.step()

    def _engines(self, inner: list[nn.Module]) -> list[Any]:
        """The training engine of each model; None for a model prepared without optimizer (frozen)."""
        return [self.engine_of(m) if self.engine_of is not None else None for m in inner]

    def _stage(self, engine: Any) -> Optional[int]:
        return int(engine.zero_optimization_stage()) if engine is not None else self.zero_stage

    def entries(self, inner: list[nn.Module], optimizers: list[Any]) -> tuple[list[dict], list[bool]]:
        """A trained model's entry names its engine checkpoint; a frozen one's (``"frozen"``) its
        full weights, ``deepspeed/model_<i>.safetensors``: it has no optimizer to keep."""
        world = self.state.num_processes
        models = []
        for i, (module, engine) in enumerate(zip(inner, self._engines(inner))):
            entry = {KEY: f"model_{i}", "zero_stage": self._stage(engine), "world_size": world,
                     "shapes": _shapes(module)}
            if engine is None:
                entry["frozen"] = True
            models.append(entry)
        return models, [True] * len(optimizers)

    @staticmethod
    def optimizer_entry(index: int, with_state: bool) -> Optional[str]:
        return "engine"  # inside the engine checkpoint of its model

    def writer(self, acc: Any, folder: str, inner: list[nn.Module], with_state: list[bool], group: Any) -> Any:
        return functools.partial(self.save, folder, inner)

    def save(self, folder: str, inner: list[nn.Module]) -> dict[str, str]:
        """Every process writes its partitions, then makes the files it can see durable; returns the
        checksums of its own files (``{manifest name: checksum}``) for the manifest."""
        path = os.path.join(folder, SUBDIR)
        os.makedirs(path, exist_ok=True)
        for i, (module, engine) in enumerate(zip(inner, self._engines(inner))):
            if engine is not None:
                engine.save_checkpoint(path, tag=f"model_{i}", save_latest=False)
            else:
                self._save_frozen(module, os.path.join(path, f"model_{i}.safetensors"))
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

    def _save_frozen(self, module: nn.Module, target: str) -> None:
        """A frozen model's full weights (gathered on every process), written by process 0."""
        if self.weights_of is None:
            raise ValueError(f"save_state: {type(module).__name__} has no DeepSpeed engine and this run cannot "
                             "gather its weights")
        weights = self.weights_of(module)
        if self.state.process_index == 0:
            from ..saving import _prepare, write_weights_file

            kept, aliases = _prepare(weights, True, "save_state")
            write_weights_file(target, kept, aliases, None)

    @staticmethod
    def listing(folder: str) -> dict[str, dict[str, Any]]:
        out = {}
        base = os.path.join(folder, SUBDIR)
        for root, _, names in os.walk(base):
            for name in sorted(names):
                full = os.path.join(root, name)
                out[os.path.relpath(full, folder)] = {"size": os.path.getsize(full), "checksum": None, "rank": KEY}
        return out

    def _native(self, contents: dict[str, Any], inner: list[nn.Module]) -> bool:
        """Whether DeepSpeed itself can load it: a DeepSpeed run with the stage and process count that wrote it."""
        if self.engine_of is None:
            return False
        world = self.state.num_processes
        trained = [(e, self._engines([m])[0]) for e, m in zip(contents["models"], inner) if not e.get("frozen")]
        return all(engine is not None and e.get("world_size") == world and e.get("zero_stage") == self._stage(engine)
                   for e, engine in trained)

    def _this_run(self) -> str:
        kind = f"ZeRO stage {self.zero_stage}" if self.zero_stage is not None else self.run
        return f"{kind} on {self.state.num_processes} process(es)"

    def check(self, folder: str, contents: dict[str, Any], inner: list[nn.Module], optimizers: list[Any]) -> list[str]:
        """Differences between the stored engines and the live models; reads the consolidated weights
        when DeepSpeed cannot load the partitions itself (reads only, changes nothing)."""
        self.native = self._native(contents, inner)
        # Per model index: full weights to load (frozen models; every model when DeepSpeed cannot load
        # the engine checkpoint), the saved optimizer hyperparameters, the checked files of native loads.
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.groups: dict[int, Optional[list[dict[str, Any]]]] = {}
        self.checked: dict[int, dict[str, Any]] = {}
        problems = []
        engines = self._engines(inner)
        for i, (entry, module) in enumerate(zip(contents["models"], inner)):
            label = f"model {i} ({type(module).__name__}, saved by ZeRO stage {entry.get('zero_stage')} on " \
                    f"{entry.get('world_size')} processes, this run {self._this_run()})"
            live, saved = _shapes(module), entry.get("shapes", {})
            wrong = [f"{k} (checkpoint {saved.get(k)}, model {v})" for k, v in live.items() if saved.get(k) != v]
            extra = [k for k in saved if k not in live]
            if wrong or extra:
                problems.append(f"{label}: parameters differ: {', '.join((wrong + extra)[:8])}")
            if entry.get("frozen"):
                try:
                    self.weights[i] = _read_frozen(os.path.join(folder, SUBDIR, f"{entry[KEY]}.safetensors"))
                except Exception as e:  # noqa: BLE001 - an unreadable file, whatever the error, is one problem
                    problems.append(f"{label}: {e}")
                continue
            if self.native and engines[i] is None:
                problems.append(f"{label}: saved with its optimizer, but this run prepared it without one; "
                                "prepare it with its optimizer, as the run that saved it did")
                continue
            path = os.path.join(folder, SUBDIR, entry[KEY])
            if not os.path.isdir(path):
                problems.append(f"model {i}: the engine checkpoint folder {SUBDIR}/{entry[KEY]} is missing")
                continue
            if self.native:
                # Raises (on this process; load_state makes every process raise it): this process's files, read
                # once and checked, kept for DeepSpeed's load_checkpoint, which then reads none of them again.
                check_engine_api(self._engine(module))  # before anything is read: one clear error on every process
                elastic = getattr(self._engine(module), "zero_elastic_checkpoint", lambda: False)()
                names = None if elastic else own_files(path, self.state.process_index)  # elastic: every partition
                self.checked[i] = refuse_foreign_pickles(path, names)
                problems.extend(_partition_problems(self.checked[i], self._engine(module)))
                continue
            if not problems:
                try:
                    weights, groups = _quiet(_consolidate, path)  # raises on a refused or damaged file
                except ValueError as e:
                    problems.append(f"{label}: {e}")
                    continue
                missing = sorted(set(module.state_dict()) - set(weights))
                if missing:
                    problems.append(f"{label}: the consolidated weights lack {', '.join(missing[:8])}")
                self.weights[i] = weights
                self.groups[i] = groups
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
            out.append((inner_opt, self.groups.get(index)))
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
        if self.settle is not None:
            self.settle("load_state")  # a step held since the last backward runs before the state is replaced
        frozen = [i for i, e in enumerate(contents["models"]) if e.get("frozen")]
        for i in frozen:  # their full weights, whatever the run (every process loads them)
            self.load_weights(inner[i], self.weights.pop(i), strict=True)
        if not self.native:
            for i, weights in self.weights.items():
                self.load_weights(inner[i], weights, strict=False)
            for opt, groups in self._owned(inner, optimizers):
                for live, stored in zip(opt.param_groups, groups or []):
                    # The learning rate a scheduler set goes with the scheduler's state. Keys this run's
                    # optimizer lacks, and how a step runs on the writer's machine (fused, foreach...), stay.
                    live.update({k: v for k, v in stored.items() if k in live and k not in _HOW_TO_STEP})
            trained = [e for e in contents["models"] if not e.get("frozen")]
            if not trained:  # frozen models alone: their weights are all there is
                self.weights, self.groups = {}, {}
                return
            entry = trained[0]
            warnings.warn(
                f"load_state: the DeepSpeed checkpoint was written by ZeRO stage {entry.get('zero_stage')} on "
                f"{entry.get('world_size')} processes and this run is {self._this_run()}: the consolidated fp32 "
                "weights were loaded, the optimizer state (moments, step counts, fp16 loss scale) was not restored "
                "and the optimizers start fresh (with the saved hyperparameters, learning rate included); "
                "schedulers, data positions, RNG and registered objects were restored", HastenWarning,
                stacklevel=4)
            self.weights, self.groups = {}, {}
            return
        path = os.path.join(folder, SUBDIR)
        checked, self.checked = self.checked, {}
        for i, engine in enumerate(self._engines(inner)):
            if i in frozen or engine is None:
                continue
            # DeepSpeed reads every file through its engine's checkpoint engine; for this load it is one that
            # hands out what hasten read and checked (DeepSpeed's own one is put back after).
            check_engine_api(engine)
            own = engine.checkpoint_engine
            engine.checkpoint_engine = checked_engine(checked.get(i, {}))
            try:
                loaded, _ = engine.load_checkpoint(path, tag=f"model_{i}")
            finally:
                engine.checkpoint_engine = own
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load {path}/model_{i}")


# DeepSpeed's checkpoint files are pickles holding tensors, dicts and these plain records.
_RECORDS = (("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
            ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
            ("deepspeed.utils.tensor_fragment", "fragment_address"))
_KIND = "DeepSpeed checkpoint"


def _read(name: str) -> Any:
    """One engine file, read once, checked (no TorchScript, torch.save's records only) and unpickled with the
    allow-list from those very bytes. Raises ``ForbiddenPickle`` or ``CheckpointCorruptError`` naming it."""
    state = unpickling.torch_file(name, _KIND, _RECORDS)
    if not isinstance(state, dict):  # every DeepSpeed checkpoint file holds a dict
        raise CheckpointCorruptError(f"{name!r} holds a {type(state).__name__}, not the dict DeepSpeed saves; the "
                                     "checkpoint is damaged or was tampered with")
    return state


def _read_frozen(path: str) -> dict[str, torch.Tensor]:
    """The full weights of a frozen model (safetensors: no pickle), tied names restored."""
    import json

    from ..saving import ALIASES_KEY

    if not os.path.isfile(path):
        raise ValueError(f"the weights file {os.path.relpath(path, os.path.dirname(os.path.dirname(path)))} is missing")
    view = SafetensorsView(read_path(path, what="weights file"))  # a plain file, read once
    weights = view.tensors()
    aliases = json.loads(view.metadata.get(ALIASES_KEY, "{}"))
    for name, twin in aliases.items():
        weights[name] = weights[twin]
    return weights


def _files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(path), "*.pt")))


def _partition_problems(files: dict[str, Any], engine: Any) -> list[str]:
    """ZeRO-3 partition files whose fp32 partitions differ in size from this run's: DeepSpeed would only
    find out inside ``load_checkpoint``, on the damaged rank alone, while the others go on into its
    collectives. (ZeRO-1/2 store partitions without their padding, so their sizes are DeepSpeed's to judge.)"""
    live = getattr(getattr(engine, "optimizer", None), "fp32_partitioned_groups_flat", None)
    if live is None:
        return []
    want = [int(t.numel()) for t in live]
    problems = []
    for path, content in files.items():
        state = content.get("optimizer_state_dict") if isinstance(content, dict) else None
        saved = state.get("fp32_flat_groups") if isinstance(state, dict) else None
        if saved is None:
            continue
        sizes = [int(t.numel()) if isinstance(t, torch.Tensor) else None for t in saved] \
            if isinstance(saved, (list, tuple)) else None
        if sizes != want:
            problems.append(f"{path}: its fp32 partitions hold {sizes} elements where this run's hold {want}; the "
                            "file is damaged or belongs to another run")
    return problems


def own_files(path: str, rank: int) -> list[str]:
    """The files of the engine checkpoint folder ``path`` that DeepSpeed's ``load_checkpoint`` reads on the
    process of data-parallel rank ``rank`` (its ZeRO partition and the shared model states)."""
    return [n for n in _files(path) if "zero_pp_rank_" not in os.path.basename(n)
            or f"zero_pp_rank_{rank}_" in os.path.basename(n)]


def refuse_foreign_pickles(path: str, names: Optional[list[str]] = None) -> dict[str, Any]:
    """Read ``names`` (default: every pickle of the engine checkpoint folder ``path``) with hasten's
    allow-list, each read once and checked before it is unpickled; raises ``unpickling.ForbiddenPickle``
    for a file that would run code or names anything else, ``CheckpointCorruptError`` for a damaged one.
    Returns ``{normalised path: what it holds}``: what DeepSpeed is then given (``CheckedFiles``), so a
    file replaced after the check is never read. Changes no process-wide setting."""
    return {os.path.normpath(os.path.abspath(n)): _read(n) for n in (_files(path) if names is None else names)}


def checked_engine(files: dict[str, Any]) -> Any:
    """A DeepSpeed checkpoint engine (``deepspeed.runtime.checkpoint_engine.CheckpointEngine``, the object
    DeepSpeed's engine reads every checkpoint file through) that hands out ``files`` (from
    ``refuse_foreign_pickles``: bytes hasten read once and checked) and reads any other file the same checked
    way, once: DeepSpeed never calls ``torch.load(weights_only=False)`` on a file of a hasten load, and what
    it gets for a file is what was checked, however often it asks. Lives for one ``load_checkpoint``."""
    CheckpointEngine = checkpoint_engine_class()

    class CheckedFiles(CheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            key = os.path.normpath(os.path.abspath(path))
            if key not in files:
                files[key] = _read(path)
            # DeepSpeed reads some files twice (check_ckpt_list, then the load): each read gets its own top level
            found = files[key]
            return dict(found) if isinstance(found, dict) else found

        def save(self, state_dict: Any, path: str) -> None:
            raise RuntimeError("hasten's checkpoint engine only reads (it is installed for load_checkpoint alone)")

        def create(self, info: Any) -> None:
            self.save(None, "")

        def commit(self, info: Any) -> bool:
            return True

    return CheckedFiles()


def is_engine_checkpoint(path: str) -> bool:
    """Whether ``path`` is one engine checkpoint folder (``<save dir>/<tag>``)."""
    return os.path.isdir(path) and bool(glob.glob(os.path.join(glob.escape(path), "*model_states.pt")))


def _model_state(zero_to_fp32: Any, state: Any, name: str) -> Any:
    """What DeepSpeed's ``zero_to_fp32.parse_model_states`` takes from one model states file."""
    if not isinstance(state, dict) or "buffer_names" not in state or not isinstance(state.get("module"), dict):
        raise ValueError(f"{name!r} is not a DeepSpeed model states file (no buffer_names or module)")
    names = state["buffer_names"]
    buffers = {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items()
               if k in names and isinstance(v, torch.Tensor)}
    return _zero_call(zero_to_fp32, "zero_model_state",
        buffers=buffers, param_shapes=state["param_shapes"],
        shared_params=[[k, v] for k, v in (state.get("shared_params") or {}).items()],
        ds_version=state.get("ds_version"), frozen_param_shapes=state.get("frozen_param_shapes"),
        frozen_param_fragments=state.get("frozen_param_fragments"))


def _groups(base: Any) -> Optional[list[dict[str, Any]]]:
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(groups, list):
        return None
    return [{k: v for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]


def _consolidate(path: str) -> tuple[dict[str, torch.Tensor], Optional[list[dict[str, Any]]]]:
    """(full fp32 weights, hyperparameters of each parameter group) of the engine checkpoint folder ``path``,
    every file read once and checked; DeepSpeed's ``zero_to_fp32`` merges what was read (it reads no file).
    Raises ``ForbiddenPickle``/``CheckpointCorruptError`` naming a refused file, ``ValueError`` otherwise."""
    from deepspeed.utils import zero_to_fp32

    model_files = _zero_call(zero_to_fp32, "get_model_state_files", path)
    optim_files = _zero_call(zero_to_fp32, "get_optim_files", path) if glob.glob(os.path.join(glob.escape(path),
                                                                              "*optim_states.pt")) else []
    models = [(name, _read(name)) for name in model_files]
    if not optim_files:  # no ZeRO (stage 0): the model states file holds the whole module and the optimizer
        state = models[0][1]
        if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
            raise ValueError(f"{model_files[0]!r} is not a DeepSpeed model states file (no module)")
        weights = {k: v for k, v in state["module"].items() if isinstance(v, torch.Tensor)}
        return weights, _groups(state.get("optimizer"))
    zero_models = [_model_state(zero_to_fp32, state, name) for name, state in models]
    del models
    flat, groups, stage, world, paddings = [], None, None, None, None
    for i, name in enumerate(optim_files):
        wrapper = _read(name).get("optimizer_state_dict")
        if not isinstance(wrapper, dict) or "zero_stage" not in wrapper:
            raise ValueError(f"{name!r} is not a DeepSpeed ZeRO optimizer states file (no zero_stage)")
        if i == 0:  # ZeRO 1/2 (and bf16): "base_optimizer_state"; ZeRO 3: "optimizer_state_dict"
            groups = _groups(wrapper.get("base_optimizer_state") or wrapper.get("optimizer_state_dict"))
            stage, world = int(wrapper["zero_stage"]), wrapper["partition_count"]
            world = max(world) if isinstance(world, list) else int(world)
            paddings = wrapper.get("param_alignment_paddings")
        wrapper.pop("optimizer_state_dict", None)  # the moments: only the fp32 master weights are needed
        flat.append(wrapper["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"])
    if world != len(optim_files):
        raise ValueError(f"cannot rebuild the weights of the DeepSpeed checkpoint {path!r}: it holds "
                         f"{len(optim_files)} optimizer states files but was written by {world} processes; it is "
                         "incomplete or damaged (files are missing or come from another checkpoint)")
    if stage <= 2:
        state = _zero_call(zero_to_fp32, "_get_fp32_state_dict_from_zero2_checkpoint", world, flat, zero_models,
                           False, paddings)
    else:
        state = _zero_call(zero_to_fp32, "_get_fp32_state_dict_from_zero3_checkpoint", world, flat, zero_models,
                           False)
    return {k: v.detach() for k, v in _zero_call(zero_to_fp32, "to_torch_tensor", state).items()}, groups


def consolidated_weights(path: str) -> dict[str, torch.Tensor]:
    """The full fp32 weights of the engine checkpoint folder ``path`` (``<save dir>/<tag>``), rebuilt
    from every process's ZeRO partitions in this process alone (no process group, no engine).
    Raises ``ValueError`` with one line naming what is missing, damaged or refused (and nothing runs)."""
    if not is_engine_checkpoint(path):
        raise ValueError(f"{path!r} holds no DeepSpeed model states (*model_states.pt); pass an engine checkpoint "
                         "folder (the folder save_checkpoint wrote for one tag)")
    try:
        import deepspeed.utils.zero_to_fp32  # noqa: F401
    except ImportError:
        raise ValueError("reading a DeepSpeed checkpoint needs DeepSpeed: pip install 'hasten[deepspeed]' (on CPU "
                         "with DS_BUILD_OPS=0)") from None
    try:
        return _quiet(_consolidate, path)[0]
    except (ValueError, DeepSpeedVersionError):  # a version mismatch is not a damaged checkpoint
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - refused or damaged files (named), foreign contents
        if _names_a_file(e):
            raise ValueError(str(e)) from None
        raise ValueError(f"cannot rebuild the weights of the DeepSpeed checkpoint {path!r} ({type(e).__name__}: "
                         f"{_first_line(e)}); it is incomplete or damaged") from None


def _names_a_file(error: BaseException) -> bool:
    return isinstance(error, (ForbiddenPickle, CheckpointCorruptError))


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else "no message"


def _quiet(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with DeepSpeed's prints (progress bars, "Processing zero checkpoint") kept quiet."""
    noise = io.StringIO()
    with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
        return function(*args)


_HOW_TO_STEP = ("foreach", "fused", "capturable", "differentiable")


from .backends import register  # noqa: E402
from ..warning_kinds import HastenWarning

register(KEY, DeepSpeedCheckpoint.for_reading)
