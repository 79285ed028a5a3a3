"""Issue 23, "no file read runs code": every file kind hasten reads with pickle, tampered every way
(tests/attack_payloads.py), is refused with one error naming the file, and nothing in it runs.

Kinds: DeepSpeed engine files (the allow-list check, the checkpoint engine DeepSpeed's load_checkpoint is
given, merge-weights' consolidation), the files of an Accelerate ``save_state`` folder (load_state
migration), hasten's own ``.pt`` states, and the weights-only loaders of other modules (torch refuses
TorchScript under ``weights_only=True``: proved here). DeepSpeed on 2 real processes (ZeRO-3 and ZeRO-2,
one rank's file damaged) runs in tests/checks_attack_code.py.

The default run takes a sample of the payloads (a few seconds); HASTEN_ATTACK_FULL=1 runs the whole grid.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings

import numpy as np
import pytest
import torch
from attack_payloads import PAYLOADS, RAN, SAMPLE
from torch import nn

from hasten.files.errors import CheckpointCorruptError
from hasten.checkpointing.layout import IncompleteCheckpointError
from hasten.files.unpickling import ForbiddenPickle

FULL = bool(os.environ.get("HASTEN_ATTACK_FULL"))
_full_only = pytest.mark.skipif(not FULL, reason="the whole attack grid runs with HASTEN_ATTACK_FULL=1")


def grid(payloads=tuple(PAYLOADS)) -> list:
    return [pytest.param(p, marks=() if p in SAMPLE else _full_only) for p in payloads]


def grid2(names: list, payloads=tuple(PAYLOADS)) -> list:
    """(file, payload) pairs; the default run gives each sampled payload to one file in turn (every file and
    every sampled payload appears once or more), the full run takes every pair."""
    sample = [p for p in payloads if p in SAMPLE]
    out = []
    for payload in payloads:
        for i, name in enumerate(names):
            chosen = payload in sample and sample.index(payload) % len(names) == i
            out.append(pytest.param(name, payload, marks=() if chosen else _full_only, id=f"{payload}-{name}"))
    return out


def judge(capfd, call, kind: str, path: str, marker: str, allowed=()) -> BaseException | None:
    """Run ``call``: nothing may run (no marker file, no TorchScript code, torch.jit.load never reached);
    a code payload must be refused; any error is hasten's, names the file and is one clear message."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            call()
            outcome = None
        except Exception as e:  # noqa: BLE001 - judged below
            outcome = e
    out = capfd.readouterr()
    assert RAN not in out.out + out.err, "TorchScript code ran"
    assert not os.path.exists(marker), "a pickle gadget ran"
    assert not [w for w in seen if "TorchScript" in str(w.message)], "torch.load dispatched to torch.jit.load"
    if kind == "code":
        assert outcome is not None, f"{path} loaded"
    if outcome is not None:
        classes = (ForbiddenPickle, CheckpointCorruptError, IncompleteCheckpointError, pickle.UnpicklingError) + allowed
        assert isinstance(outcome, classes) and type(outcome) is not RuntimeError, repr(outcome)
        assert path in str(outcome), f"the error does not name {path}: {outcome}"
        for bare in ("Traceback", "RecursionError: maximum", "BadZipFile"):
            assert bare not in str(outcome).split(path)[0], outcome
    return outcome


def _tampered(tmp_path, name: str, good: bytes, payload: str) -> tuple[str, str]:
    marker = str(tmp_path / "created_by_a_pickle")
    data = PAYLOADS[payload][1](good, marker)
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path, marker


def _saved(obj, legacy: bool = False) -> bytes:
    import io

    out = io.BytesIO()
    torch.save(obj, out, _use_new_zipfile_serialization=not legacy)
    return out.getvalue()


# -- DeepSpeed engine files ---------------------------------------------------------------------------------
_MODEL_STATES = {"module": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}, "buffer_names": [],
                 "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}, "param_shapes": None}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("payload", grid())
def test_deepspeed_engine_file_refused(tmp_path, capfd, payload, legacy):
    """refuse_foreign_pickles (load_state's check of each engine file) and the checkpoint engine DeepSpeed's
    load_checkpoint reads through."""
    from hasten.checkpointing import deepspeed_state

    folder = tmp_path / "model_0"
    folder.mkdir()
    path, marker = _tampered(folder, "mp_rank_00_model_states.pt", _saved(_MODEL_STATES, legacy), payload)
    kind = PAYLOADS[payload][0]
    judge(capfd, lambda: deepspeed_state.refuse_foreign_pickles(str(folder)), kind, path, marker)


@pytest.mark.parametrize("payload", grid())
def test_without_sealed_copies_the_bytes_read_are_checked(tmp_path, capfd, monkeypatch, payload):
    """Where the system has no sealed in-memory files (not Linux), the file is read into bytes and those are
    checked and loaded: the same refusals."""
    from hasten.checkpointing import deepspeed_state
    from hasten.files import unpickling

    monkeypatch.setattr(unpickling, "_sealed_copy", lambda path: None)
    folder = tmp_path / "model_0"
    folder.mkdir()
    path, marker = _tampered(folder, "mp_rank_00_model_states.pt", _saved(_MODEL_STATES), payload)
    outcome = judge(capfd, lambda: deepspeed_state.refuse_foreign_pickles(str(folder)), PAYLOADS[payload][0], path,
                    marker)
    if outcome is None and payload == "flip_directory":
        raise AssertionError("a flipped zip directory loaded")


def test_sealed_copy_cannot_be_changed(tmp_path):
    """The copy torch reads is sealed: writing to it, growing or shrinking it fails."""
    from hasten.files import unpickling

    path = tmp_path / "a.pt"
    path.write_bytes(_saved({"w": torch.ones(3)}))
    fd = unpickling._sealed_copy(str(path))
    if fd is None:
        pytest.skip("no sealed in-memory files on this system")
    try:
        with pytest.raises(OSError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(OSError):
            os.ftruncate(fd, 1)
        assert os.pread(fd, 1 << 20, 0) == path.read_bytes()
    finally:
        os.close(fd)


@pytest.mark.parametrize("payload", grid())
def test_deepspeed_checked_engine_reads_no_code(tmp_path, capfd, payload):
    """A file DeepSpeed asks for that hasten did not read before is read once and checked too."""
    pytest.importorskip("deepspeed")
    from hasten.checkpointing import deepspeed_state

    path, marker = _tampered(tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt", _saved(_MODEL_STATES), payload)
    engine = deepspeed_state.checked_engine({})
    judge(capfd, lambda: engine.load(path, map_location="cpu"), PAYLOADS[payload][0], path, marker)


def test_deepspeed_checked_engine_hands_out_what_was_checked(tmp_path, capfd):
    """Time of check = time of use: a file swapped after hasten checked it is never read again."""
    pytest.importorskip("deepspeed")
    from attack_payloads import torchscript

    from hasten.checkpointing import deepspeed_state

    folder = tmp_path / "model_0"
    folder.mkdir()
    path = folder / "mp_rank_00_model_states.pt"
    path.write_bytes(_saved(_MODEL_STATES))
    checked = deepspeed_state.refuse_foreign_pickles(str(folder), deepspeed_state.own_files(str(folder), 0))
    path.write_bytes(torchscript())  # swapped between check and use
    engine = deepspeed_state.checked_engine(checked)
    got = engine.load(str(path), map_location="cpu")
    assert torch.equal(got["module"]["w"], _MODEL_STATES["module"]["w"])
    again = engine.load(str(path), map_location="cpu")  # DeepSpeed asks twice for some files: the same contents
    assert torch.equal(again["module"]["w"], _MODEL_STATES["module"]["w"])
    assert RAN not in capfd.readouterr().out


@pytest.mark.parametrize("payload", grid())
def test_merge_weights_consolidation_refuses(tmp_path, capfd, payload):
    """merge-weights' DeepSpeed path (consolidated_weights): ValueError naming the file, nothing runs."""
    pytest.importorskip("deepspeed")
    from hasten.checkpointing import deepspeed_state

    folder = tmp_path / "model_0"
    folder.mkdir()
    path, marker = _tampered(folder, "mp_rank_00_model_states.pt", _saved(_MODEL_STATES), payload)
    judge(capfd, lambda: deepspeed_state.consolidated_weights(str(folder)), PAYLOADS[payload][0], path, marker,
          allowed=(ValueError,))


# -- Accelerate save_state folders ----------------------------------------------------------------------------
class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _live():
    from distributed import reset_state

    from hasten import Accelerator

    reset_state()
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    counter = _Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched, counter


@pytest.fixture(scope="module")
def accelerate_folder(tmp_path_factory):
    """A folder as Accelerate's save_state writes it for one process (its file names and torch.save formats)."""
    folder = tmp_path_factory.mktemp("accelerate") / "checkpoint"
    folder.mkdir()
    acc, model, opt, sched, counter = _live()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    counter.count = 7
    torch.save(acc.unwrap_model(model).state_dict(), folder / "pytorch_model.bin")
    torch.save(opt.optimizer.state_dict() if hasattr(opt, "optimizer") else opt.state_dict(), folder / "optimizer.bin")
    torch.save(sched.state_dict(), folder / "scheduler.bin")
    torch.save(counter.state_dict(), folder / "custom_checkpoint_0.pkl")
    torch.save({"step": 3, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, folder / "random_states_0.pkl")
    acc.end_training()
    return folder


def _load_accelerate(folder, allow_pickle: bool = False) -> None:
    acc = _live()[0]
    acc.load_state(str(folder), **({"load_kwargs": {"weights_only": False}} if allow_pickle else {}))


def test_accelerate_folder_loads_untampered(accelerate_folder, tmp_path):
    folder = shutil.copytree(accelerate_folder, tmp_path / "c")
    acc, *_, counter = _live()
    acc.load_state(str(folder))
    assert counter.count == 7 and acc.step == 3


_ACCELERATE_FILES = ["pytorch_model.bin", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl",
                     "random_states_0.pkl"]


@pytest.mark.parametrize("name,payload", grid2(_ACCELERATE_FILES))
def test_accelerate_folder_file_refused(accelerate_folder, tmp_path, capfd, name, payload):
    folder = shutil.copytree(accelerate_folder, tmp_path / "c")
    good = (folder / name).read_bytes()
    path, marker = _tampered(folder, name, good, payload)
    judge(capfd, lambda: _load_accelerate(folder), PAYLOADS[payload][0], path, marker)


_CODE = [p for p, (kind, _) in PAYLOADS.items() if kind == "code" and not p.startswith("gadget")]


@pytest.mark.parametrize("name,payload", grid2(_ACCELERATE_FILES, _CODE + ["gadget", "gadget_in_zip"]))
def test_accelerate_folder_with_allow_pickle(accelerate_folder, tmp_path, capfd, name, payload):
    """weights_only=False opts in to pickle for registered objects' files only: TorchScript is refused in every
    file, pickle gadgets in every other file."""
    if name == "custom_checkpoint_0.pkl" and payload.startswith("gadget"):
        pytest.skip("the user opted in to pickle for this file (Accelerate's semantics)")
    folder = shutil.copytree(accelerate_folder, tmp_path / "c")
    path, marker = _tampered(folder, name, (folder / name).read_bytes(), payload)
    judge(capfd, lambda: _load_accelerate(folder, allow_pickle=True), "code", path, marker)


@pytest.mark.parametrize("payload", grid())
def test_accelerate_scaler_and_loader_files_refused(tmp_path, capfd, payload):
    """scaler.pt (fp16 on a GPU) and dl_state_dict.bin go through the same reader."""
    from hasten.checkpointing import accelerate_folder

    for name in ("scaler.pt", "dl_state_dict.bin"):
        path, marker = _tampered(tmp_path, name, _saved({"scale": torch.tensor(1024.0), "_num_yielded": 3}), payload)
        judge(capfd, lambda: accelerate_folder._torch_load(path), PAYLOADS[payload][0], path, marker)


def test_accelerate_missing_random_states_is_an_error(accelerate_folder, tmp_path):
    """A folder with random_states_0 and _2 but no _1, resumed by its process 1 -> here process 0 of a folder
    claiming 2 processes whose file 0 is missing."""
    folder = shutil.copytree(accelerate_folder, tmp_path / "c")
    os.rename(folder / "random_states_0.pkl", folder / "random_states_1.pkl")
    with pytest.raises(IncompleteCheckpointError, match="random_states_0.pkl"):
        _load_accelerate(folder)


@pytest.mark.parametrize("change", ["python", "torch", "numpy", "type"])
def test_accelerate_wrong_random_states_are_an_error(accelerate_folder, tmp_path, change):
    """A random_states file of the right format holding something else: refused before anything changes."""
    folder = shutil.copytree(accelerate_folder, tmp_path / "c")
    state = torch.load(folder / "random_states_0.pkl", weights_only=False)
    if change == "python":
        state["random_state"] = (3, (1, 2, 3), None)
    elif change == "torch":
        state["torch_manual_seed"] = torch.zeros(7, dtype=torch.uint8)
    elif change == "numpy":
        state["numpy_random_seed"] = ("MT19937", np.zeros(3, dtype=np.uint32), 0, 0, 0.0)
    else:
        state = [1, 2, 3]
    torch.save(state, folder / "random_states_0.pkl")
    before = torch.get_rng_state()
    with pytest.raises(CheckpointCorruptError, match="random_states_0.pkl"):
        _load_accelerate(folder)
    assert torch.equal(before, torch.get_rng_state())


# -- hasten's own .pt states (registered objects saved with pickle) --------------------------------------------
@pytest.mark.parametrize("payload", grid(_CODE))
def test_hasten_pt_state_refuses_torchscript_even_with_allow_pickle(tmp_path, capfd, payload):
    from hasten.checkpointing import restorer

    class _Mapped:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def bytes(self) -> bytes:
            return self.data

    path, marker = _tampered(tmp_path, "custom_0.pt", _saved({"x": 1}), payload)
    reader = restorer.Reader.__new__(restorer.Reader)
    reader.folder = str(tmp_path)
    data = open(path, "rb").read()
    reader.file = lambda name: _Mapped(data)
    judge(capfd, lambda: restorer._unpickle(reader, "custom_0.pt", True), "code", path, marker)


# -- weights-only loaders of other modules: torch refuses TorchScript archives under weights_only=True ----------
def _weights_only_loaders():
    import io

    from hasten.checkpointing.dcp_reader import WeightsOnlyPlanner
    from hasten.model_loading import _read_source
    from hasten.utils.modeling import load_state_dict
    from hasten.utils.other import load

    def dcp_bytes(path):  # a DCP checkpoint's non-tensor value, as DCP hands it to the planner
        with open(path, "rb") as f:
            WeightsOnlyPlanner().load_bytes(None, io.BytesIO(f.read()))

    return {"utils.load": load, "load_state_dict": load_state_dict, "model_loading": _read_source,
            "dcp_bytes": dcp_bytes, "torch.load": lambda path: torch.load(path, weights_only=True)}


@pytest.mark.parametrize("loader", ["utils.load", "load_state_dict", "model_loading", "dcp_bytes", "torch.load"])
@pytest.mark.parametrize("payload", ["torchscript", "torchscript_other_prefix", "constants_added", "gadget"])
def test_weights_only_loaders_refuse_torchscript(tmp_path, capfd, loader, payload):
    path, marker = _tampered(tmp_path, "pytorch_model.bin", _saved({"w": torch.ones(2)}), payload)
    call = _weights_only_loaders()[loader]
    capfd.readouterr()
    with pytest.raises(Exception):  # noqa: B017 - torch's RuntimeError/UnpicklingError, or hasten's
        call(path)
    out = capfd.readouterr()
    assert RAN not in out.out + out.err and not os.path.exists(marker)


# -- DeepSpeed on 2 real processes (tests/checks_attack_code.py) ------------------------------------------------
@pytest.fixture(scope="module")
def two():
    pytest.importorskip("deepspeed")
    from distributed import run_checks

    return run_checks("checks_attack_code", world_size=2, timeout=600)


@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_one_rank_file_tampered_every_rank_raises_the_same(two, stage):
    """Issue 23 item 5: one process's engine file replaced or damaged; every process raises the same error
    naming the file (no process left in a collective, no SIGABRT), nothing runs, nothing changes."""
    values = [v[:-1] if stage == 3 else v for v in two.assert_passed(f"check_zero{stage}_one_rank_file_tampered")]
    assert values[0] == values[1], values
    assert values[0], "no case ran"


def test_deepspeed_load_checkpoint_uses_the_checked_bytes(two):
    """Time of check = time of use with real ZeRO-3 engines: every file swapped for a TorchScript archive after
    hasten read and checked it; DeepSpeed's load_checkpoint loads the checked contents, nothing runs."""
    assert [v[-1] for v in two.assert_passed("check_zero3_one_rank_file_tampered")] == [True, True]


@pytest.mark.parametrize("name", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
@pytest.mark.parametrize("payload", grid())
def test_merge_weights_deepspeed_payloads_one_line_exit_2(two, tmp_path, capfd, name, payload):
    from test_cli import one_line_error

    root = two.assert_passed("check_zero_checkpoint_for_merge_weights")[0]
    evil = tmp_path / "evil"
    shutil.copytree(root, evil)
    path, marker = _tampered(evil, name, (evil / name).read_bytes(), payload)

    class _Both:  # one_line_error reads capsys; capfd sees what TorchScript prints from C++ too
        def readouterr(self):
            return capfd.readouterr()

    capfd.readouterr()
    try:
        err = one_line_error(_Both(), ["merge-weights", str(evil), str(tmp_path / "o")])
    except AssertionError:
        if PAYLOADS[payload][0] == "code":
            raise
        err = ""  # a flip in tensor data that no format check can see may merge (checksums are another slice)
    assert RAN not in err and not os.path.exists(marker), err
    if err:
        assert path in err and not (tmp_path / "o").exists(), err


@pytest.mark.parametrize("name", ["pytorch_model.bin", "optimizer.bin", "random_states_0.pkl"])
def test_accelerate_folder_with_a_linked_file_is_refused(accelerate_folder, tmp_path, name):
    """A link inside an Accelerate folder may lead anywhere on the machine: refused, naming it, before any read."""
    folder = shutil.copytree(accelerate_folder, tmp_path / "c")
    outside = tmp_path / "outside.bin"
    shutil.move(folder / name, outside)
    os.symlink(outside, folder / name)
    with pytest.raises(Exception, match="symbolic link") as caught:
        _load_accelerate(folder)
    assert name in str(caught.value)


def test_accelerate_folder_damaged_safetensors_is_named(accelerate_folder, tmp_path):
    """safetensors' own errors ("header too small") do not say which file: hasten's does."""
    folder = shutil.copytree(accelerate_folder, tmp_path / "c")
    (folder / "pytorch_model.bin").unlink()
    (folder / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(Exception, match="model.safetensors.*not a (readable )?safetensors file"):
        _load_accelerate(folder)


def test_deepspeed_engine_file_that_is_a_link_is_refused(tmp_path):
    from hasten.checkpointing import deepspeed_state
    from hasten.files.errors import CheckpointCorruptError

    folder = tmp_path / "model_0"
    folder.mkdir()
    real = tmp_path / "elsewhere.pt"
    real.write_bytes(_saved(_MODEL_STATES))
    os.symlink(real, folder / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointCorruptError, match="mp_rank_00_model_states.pt.*symbolic link"):
        deepspeed_state.refuse_foreign_pickles(str(folder))


def test_dcp_value_holding_a_torchscript_archive_is_refused(tmp_path, capfd):
    """DCP stores non-tensor values as bytes that its planner unpickles: a TorchScript archive there is refused
    by name (torch's weights-only load raises a bare RuntimeError for it) and its code never runs."""
    import torch.distributed.checkpoint as dcp

    from attack_payloads import torchscript
    from hasten.checkpointing import dcp_reader

    folder = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "extra": {"lr": 0.1}}, checkpoint_id=folder, no_dist=True)
        # The value's bytes become a TorchScript archive appended to its shard, as a crafted folder would hold.
        metadata = pickle.load(open(os.path.join(folder, ".metadata"), "rb"))
        key = next(k for k in metadata.storage_data if k.fqn.startswith("extra"))
        info = metadata.storage_data[key]
        shard = os.path.join(folder, info.relative_path)
        archive = torchscript()
        offset = os.path.getsize(shard)
        with open(shard, "ab") as f:
            f.write(archive)
        metadata.storage_data[key] = type(info)(info.relative_path, offset, len(archive))
        with open(os.path.join(folder, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
        state = {"w": torch.zeros(2), "extra": {"lr": 0.0}}
        with pytest.raises(Exception, match="TorchScript") as caught:
            dcp_reader.load_folder(state, folder)
    assert "'extra.lr' is not what a checkpoint save stores" in str(caught.value)
    assert RAN not in capfd.readouterr().out
