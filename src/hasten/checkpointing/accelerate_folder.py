"""Loading a folder written by Hugging Face Accelerate's ``save_state`` (migration mid-training).

Accelerate writes plain files next to each other: ``model.safetensors`` or ``pytorch_model.bin``
(``_1``, ``_2`` ... for more models), ``optimizer.bin``, ``scheduler.bin``, ``scaler.pt`` (fp16 on
a GPU), ``custom_checkpoint_<i>.pkl``, ``dl_state_dict.bin`` (torchdata's stateful loaders only),
``sampler.bin`` (a pickled sampler object) and ``random_states_<rank>.pkl``. Everything is read
with torch's weights-only unpickler, which refuses any global outside a short allow-list *before*
running anything; the RNG files need NumPy's array reconstructors, which are allowed for those files
alone. Each file is copied once and its bytes checked first (``unpickling.load_checked``: a TorchScript
archive, which torch.load would hand to torch.jit.load, is refused even where pickle is allowed), and
those bytes are what is loaded. A damaged, tampered or missing ``random_states_*.pkl`` is an error
naming the file, never a silent keep of the current generators. As in hasten's own loader, every
file is read and compared with the live objects on every process before anything changes.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from typing import Any, Callable, Optional

import torch

from ..files import unpickling
from . import layout, restorer, rng
from ..files.errors import CheckpointCorruptError
from ..files.paths import is_link
from ..files.reading import read_path
from ..files.safetensors_format import SafetensorsView
from ..warning_kinds import HastenWarning

_MODEL = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin)$")
_SIGNS = re.compile(r"^(pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|"
                    r"random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|scaler\.pt)$")
_HASTEN = re.compile(r"^(grads_)?rank_\d+\.safetensors$")
_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
_CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
_SHARDED = re.compile(r"^(pytorch_model_fsdp(_\d+)?|optimizer_\d+|latest|pytorch_model(_\d+)?)$")

_ADVICE = ("hasten reads Accelerate's files with the weights-only unpickler only; if you trust the file, "
           "load it yourself with torch.load(..., weights_only=False) and call load_state_dict")
_CUSTOM_ADVICE = ("a registered object's state that needs pickle loads only with load_state(..., "
                  "load_kwargs={'weights_only': False}), if you trust the file")


def is_accelerate_folder(folder: str) -> bool:
    """No hasten manifest nor per-process file, and a file only Accelerate's ``save_state`` writes (its
    pickled ``.bin``/``.pkl`` files: a hasten folder holds safetensors only, so an interrupted hasten
    save keeps its own "no manifest" error)."""
    if not os.path.isdir(folder) or os.path.exists(os.path.join(folder, layout.MANIFEST)):
        return False
    names = os.listdir(folder)
    if any(_HASTEN.match(name) for name in names):
        return False
    return any(_SIGNS.match(name) for name in names)


def _numbered(names: set[str], stem: str, ext: str) -> list[str]:
    """``stem.ext``, ``stem_1.ext``, ... as long as they exist (Accelerate's numbering)."""
    out = []
    while True:
        name = f"{stem}{'' if not out else f'_{len(out)}'}.{ext}"
        if name not in names:
            return out
        out.append(name)


def _model_files(names: set[str]) -> list[str]:
    out = []
    for i in range(len([n for n in names if _MODEL.match(n)])):
        end = f"_{i}" if i else ""
        for name in (f"model{end}.safetensors", f"pytorch_model{end}.bin"):
            if name in names:  # Accelerate prefers the safetensors file when both exist
                out.append(name)
                break
        else:
            break
    return out


def _dict(path: str, value: Any, keys: tuple = (), tensors: bool = False) -> Any:
    """``value`` (the contents of ``path``) if it is a dict holding ``keys`` (and only tensors when ``tensors``):
    a damaged or replaced file of the right format is named here, not as a bare AttributeError later."""
    ok = isinstance(value, dict) and all(k in value for k in keys)
    if ok and tensors:
        ok = all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    if not ok:
        what = f"a {type(value).__name__}" if not isinstance(value, dict) else "a dict of other contents"
        raise CheckpointCorruptError(f"{path!r} holds {what}, not the state Accelerate saves in "
                                     f"{os.path.basename(path)}; the checkpoint is damaged or was tampered with")
    return value


def _torch_load(path: str, allow_pickle: bool = False, advice: str = _ADVICE) -> Any:
    """A torch file of the folder, copied once and checked (torch.save's zip records or a legacy pickle: never
    a TorchScript archive, which torch.load would run, allow_pickle or not), then loaded from that copy."""
    from ..files import weights_only

    if allow_pickle:  # the caller trusts the file (load_kwargs={'weights_only': False})
        return unpickling.load_checked(path, "torch.save", (pickle.UnpicklingError,), weights_only=False)
    try:  # hasten's allow-list unpickler: every size the file states bounded by the file
        return weights_only.load(path)
    except unpickling.ForbiddenGlobal as e:
        found = re.search(r"refers to the global [^\s,]+", str(e))
        reason = found.group(0) if found else _first_line(e)
        raise unpickling.ForbiddenPickle(f"{path}: refused by the weights-only unpickler ({reason}); nothing in it "
                                         f"ran; {advice}") from None


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else "no message"


# What ``random_states_*.pkl`` holds beyond tensors: NumPy's MT19937 state (an array rebuilt by NumPy's
# reconstructor, under either NumPy's 1.x or 2.x module name) and the bytes torch's pickler encodes.
_RNG_RECORDS = frozenset({("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
                          ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")})


def read_rng(path: str) -> dict[str, Any]:
    """The RNG file as hasten's ``rng.restore`` state plus ``step``, checked (``rng.check``) before anything
    is set. Raises ``ForbiddenPickle`` (a file that would run code or names a foreign global) or
    ``CheckpointCorruptError`` (damaged, or not Accelerate's random states), naming the file."""
    # a per-call allow-list (no process-wide torch.serialization.safe_globals switch)
    saved = unpickling.torch_file(path, "Accelerate RNG state", _RNG_RECORDS)
    try:
        state: dict[str, Any] = {"step": int(saved.get("step", 0)), "python": saved["random_state"],
                                 "torch": saved["torch_manual_seed"]}
        if "numpy_random_seed" in saved:
            kind, keys, pos, has_gauss, cached = saved["numpy_random_seed"]
            state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                              "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        for ours, theirs in (("cuda", "torch_cuda_manual_seed"), ("xpu", "torch_xpu_manual_seed")):
            if theirs in saved:
                state[ours] = list(saved[theirs])
        rng.check(state)
    except (Exception, RecursionError) as e:  # noqa: BLE001 - a file of the right format holding something else
        raise CheckpointCorruptError(f"{path!r} does not hold Accelerate's random states ({type(e).__name__}: "
                                     f"{_first_line(e)}); the checkpoint is damaged or was tampered with (remove "
                                     "the folder's random_states_*.pkl files to resume without them)") from None
    return state


def _refuse_links(folder: str, names: set[str]) -> None:
    """Symbolic links may lead anywhere on the machine: an Accelerate folder is read only when neither it
    nor any entry in it is one (Accelerate writes plain files and folders)."""
    links = sorted(n for n in names if is_link(os.path.join(folder, n)))
    if is_link(os.path.normpath(folder)) or links:
        what = ", ".join(repr(os.path.join(folder, n)) for n in links[:5]) or repr(folder)
        raise CheckpointCorruptError(f"{what} {'are symbolic links' if len(links) > 1 else 'is a symbolic link'}; "
                                     "hasten reads checkpoint files only from real files inside the folder (nothing "
                                     "was read); copy the real files in if you trust them")


def _read_model(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        try:  # read once, a plain file: the tensors are views of those bytes
            return SafetensorsView(read_path(path, what="checkpoint file")).tensors()
        except CheckpointCorruptError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors do not name the file
            raise CheckpointCorruptError(f"{path!r} is not a readable safetensors file ({type(e).__name__}: "
                                         f"{_first_line(e)}); the checkpoint is damaged") from None
    return _dict(path, _torch_load(path), tensors=True)


def _fill_ties(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Accelerate's safetensors files keep one name of each tied group; give the others the same tensor."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and tensor.numel() and not hasattr(tensor, "to_local"):
            groups.setdefault((tensor.data_ptr(), tuple(tensor.shape), tensor.dtype), []).append(name)
    for names in groups.values():
        present = [n for n in names if n in state]
        for name in names:
            if present and name not in state:
                state[name] = state[present[0]]


def _count(problems: list, what: str, found: list[str], live: int, fix: str) -> bool:
    if len(found) == live:
        return True
    problems.append(("mismatch", f"it holds {len(found)} {what} ({', '.join(found) or 'none'}) but {live} are "
                     f"prepared; {fix}"))
    return False


def _read(acc: Any, folder: str, names: set[str], allow_pickle: bool, custom_later: bool,
          problems: list) -> dict[str, Any]:
    """Every state this process needs, compared with the live objects (nothing applied)."""
    out: dict[str, Any] = {"models": [], "optimizers": [], "schedulers": [], "custom": [], "scaler": None,
                           "rng": None, "loaders": []}
    sharded = sorted(n for n in names if _SHARDED.match(n) and os.path.isdir(os.path.join(folder, n)))
    if sharded or "latest" in names:
        problems.append(("mismatch", f"it holds {', '.join(sharded or ['latest'])}: a sharded FSDP or DeepSpeed "
                         "checkpoint of Accelerate, which hasten does not read; save it again from Accelerate "
                         "with a full state dict (FSDP: state_dict_type=FULL_STATE_DICT)"))
        return out
    live_backend = acc.strategy.checkpoint_backend()
    if getattr(live_backend, "EXCLUSIVE", False):
        problems.append(("mismatch", f"this run uses {live_backend.NAME}, which loads only its own checkpoints; "
                         "load the weights with load_checkpoint_in_model before prepare instead"))
        return out
    path = lambda name: os.path.join(folder, name)  # noqa: E731
    models = [acc.unwrap_model(m, keep_torch_compile=False) for m in acc._models]
    files = _model_files(names)
    if _count(problems, "models", files, len(models), "prepare the same models as the run that saved it"):
        for i, (file, model) in enumerate(zip(files, models)):
            state = _read_model(path(file))
            _fill_ties(state, model)
            label = f"model {i} ({type(model).__name__}, {file})"
            shapes = {k: tuple(v.shape) for k, v in state.items()}
            problems.extend(("mismatch", p) for p in restorer.check_shapes(shapes, model, label))
            out["models"].append(state)
    optimizers = _numbered(names, "optimizer", "bin")
    if _count(problems, "optimizer states", optimizers, len(acc._optimizers), "prepare the same optimizers"):
        for i, (file, opt) in enumerate(zip(optimizers, acc._optimizers)):
            state = _dict(path(file), _torch_load(path(file)), ("state", "param_groups"))
            problems.extend(("mismatch", f"{p} ({file})") for p in restorer.check_optimizer(state, opt, i))
            out["optimizers"].append(state)
    schedulers = _numbered(names, "scheduler", "bin")
    if _count(problems, "scheduler states", schedulers, len(acc._schedulers), "prepare the same schedulers"):
        out["schedulers"] = [_dict(path(f), _torch_load(path(f))) for f in schedulers]
    custom = sorted((n for n in names if _CUSTOM.match(n)), key=lambda n: int(_CUSTOM.match(n).group(1)))
    registered = len(acc._custom_objects)
    if custom_later and len(custom) >= registered:
        custom_ok = True
    else:
        custom_ok = _count(problems, "registered objects", custom, registered,
                           "register the same objects with register_for_checkpointing before load_state")
    if custom_ok:
        out["custom"] = [_torch_load(path(f), allow_pickle, advice=_CUSTOM_ADVICE) for f in custom]
        out["custom_files"] = [path(f) for f in custom]
    scaler_here = acc.precision.scaler is not None
    if "scaler.pt" in names and scaler_here:
        out["scaler"] = _dict(path("scaler.pt"), _torch_load(path("scaler.pt")))
    elif "scaler.pt" in names or scaler_here:
        warnings.warn("load_state: the Accelerate checkpoint and this run differ in fp16 gradient scaling; the "
                      "scaler " + ("state is ignored" if "scaler.pt" in names else "starts fresh"),
                      HastenWarning, stacklevel=5)
    out["loaders"] = _loader_positions(acc, folder, names)
    rng_files = sorted((n for n in names if _RNG.match(n)), key=lambda n: int(_RNG.match(n).group(1)))
    if rng_files:
        saved_world = len(rng_files)
        own = f"random_states_{acc.process_index % saved_world}.pkl"
        if own not in names:
            raise layout.IncompleteCheckpointError(
                f"{path(own)!r} is missing: the folder holds {', '.join(rng_files)}, so process "
                f"{acc.process_index} has no random states; the checkpoint is incomplete (restore the file, or "
                "remove every random_states_*.pkl to resume without them)")
        out["rng"] = read_rng(path(own))
        out["rng_world"] = saved_world
    else:
        warnings.warn("load_state: the Accelerate checkpoint has no random_states_*.pkl; random generators and "
                      "the step counter are left as they are", HastenWarning, stacklevel=5)
    return out


def _loader_positions(acc: Any, folder: str, names: set[str]) -> list[Optional[dict[str, Any]]]:
    """Where each prepared loader's next pass starts, as Accelerate would resume it.

    Without torchdata, Accelerate saves no position for a loader over a map-style dataset: its resume
    starts a fresh pass (scripts skip batches with ``skip_first_batches``). hasten does the same. With
    torchdata's stateful loaders Accelerate saves ``dl_state_dict.bin``; its batch count is kept."""
    out: list[Optional[dict[str, Any]]] = []
    for i, dl in enumerate(acc._dataloaders):
        file = "dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"
        if file not in names:
            out.append(None)
            continue
        state = _torch_load(os.path.join(folder, file))
        done = state.get("_num_yielded") if isinstance(state, dict) else None
        if not isinstance(done, int):
            raise ValueError(f"{file}: no batch count (_num_yielded) in this dataloader state; prepare a loader "
                             "without use_stateful_dataloader's state, or remove the file")
        sampler = dl.get_sampler() if hasattr(dl, "get_sampler") else getattr(dl, "sampler", None)
        if isinstance(sampler, torch.utils.data.RandomSampler):
            warnings.warn(f"load_state: dataloader {i} continues after {done} batches ({file}); its shuffled order "
                          "is hasten's, not torchdata's, so the samples of the rest of the epoch differ",
                          HastenWarning, stacklevel=6)
        out.append({"epoch": int(getattr(dl, "iteration", 0)), "batches_yielded": done})
    if "sampler.bin" in names:
        warnings.warn("load_state: sampler.bin (a pickled Accelerate sampler object) is not unpickled; the "
                      "loader's shuffling follows hasten's seed", HastenWarning, stacklevel=6)
    return out


def load(acc: Any, folder: str, allow_pickle: bool, custom_later: bool,
         agree: Callable[[list, str], None], kind: Callable[[BaseException], str]) -> str:
    """Check then restore an Accelerate ``save_state`` folder into ``acc``; returns the folder.
    ``agree`` and ``kind`` are ``load_state``'s: every process raises the same error, before any change."""
    problems: list[tuple[str, str]] = []
    loaded: dict[str, Any] = {}
    models = list(acc._models)
    try:
        acc._checkpoints.load_pre_hooks.run(models, folder)
        names = set(os.listdir(folder))
        _refuse_links(folder, names)
        loaded = _read(acc, folder, names, allow_pickle, custom_later, problems)
    except Exception as e:  # noqa: BLE001 - one process failing must stop every process
        problems.append((kind(e), f"process {acc.process_index}: {type(e).__name__}: {e}"))
    agree(problems, folder)

    with torch.no_grad():
        inner = [acc.unwrap_model(m, keep_torch_compile=False) for m in acc._models]
        for model, state in zip(inner, loaded["models"]):
            acc.strategy.load_model_state_dict(model, state)
        for opt, state in zip(acc._optimizers, loaded["optimizers"]):
            restorer.apply_optimizer(opt, state, inner, acc.strategy)
    acc.strategy.weights_loaded(inner)
    for sched, state in zip(acc._schedulers, loaded["schedulers"]):
        sched.load_state_dict(state)
    if loaded["scaler"] is not None:
        acc.precision.load_state_dict(loaded["scaler"])
    for dl, state in zip(acc._dataloaders, loaded["loaders"]):
        if state is not None:
            dl.load_state_dict(state)
    for obj, state, file in zip(acc._custom_objects, loaded["custom"], loaded.get("custom_files", [])):
        try:
            obj.load_state_dict(state)
        except Exception as e:  # noqa: BLE001 - the object's own check of a state only it understands
            raise CheckpointCorruptError(
                f"{file!r}: the registered {type(obj).__name__} refused the state saved there ({type(e).__name__}: "
                f"{_first_line(e)}); the file is damaged or belongs to another object (models, optimizers and "
                "schedulers were already restored)") from None
    auto = acc._auto_resume
    if custom_later and auto is not None:
        count = len(acc._custom_objects)
        auto.pending_custom = [None] * count + loaded["custom"][count:]
    notes: list[str] = []
    if loaded["rng"] is not None:
        acc.step = loaded["rng"]["step"]
        notes = rng.restore(loaded["rng"])
        if loaded["rng_world"] != acc.num_processes:
            notes.append(f"the checkpoint was saved by {loaded['rng_world']} processes and is resumed by "
                         f"{acc.num_processes}: process r takes the random states of saved process r % "
                         f"{loaded['rng_world']}")
    for note in notes:
        warnings.warn(f"load_state: {note}", HastenWarning, stacklevel=4)
    return folder
