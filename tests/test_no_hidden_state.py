"""No hidden coupling (#20): hasten keeps its state in declared attributes, not in ``__dict__`` keys.

State written straight into an object's ``__dict__`` (``obj.__dict__[key] = ...``,
``__dict__.setdefault``) or read back from it by a private key has no declaration, no type and no
owner: nothing tells a reader it exists. The scan below finds every such access in ``src/hasten``; the
allow-list names the few that are not stashes, each with the reason.
"""

from __future__ import annotations

import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "hasten"

# ``__dict__`` used as a mapping: indexed, written, or its keys tested.
_ACCESS = re.compile(r"__dict__\s*(\[|\.(setdefault|get|pop|update|clear)\(|=[^=])|\bin\s+[\w.]*__dict__\b")

# (file, fragment of the line) -> why that access is not hidden state.
ALLOWED = {
    ("state.py", "self.__dict__ = self._shared_state"):
        "Accelerate's shared-state (Borg) semantics: every PartialState/AcceleratorState/GradientState shares one dict",
    ("state.py", '"device" in self.__dict__'):
        "Borg: whether the shared dict was filled (a declared default would hide the reset-state error)",
    ("state.py", '"sync_gradients" in self.__dict__'):
        "Borg: whether the shared dict was filled",
    ("optimizer.py", "self.__dict__.update(state)"): "__setstate__ (pickling)",
    ("precision.py", "self.__dict__.update(state)"): "__setstate__ (pickling)",
    ("files/unpickling.py", "obj.__dict__.clear()"): "the restricted unpickler's BUILD step",
    ("files/unpickling.py", "obj.__dict__.update(attrs)"): "the restricted unpickler's BUILD step",
    ("scheduler.py", '"scheduler" not in self.__dict__'):
        "__getattr__ before __init__/__setstate__ ran (unpickling): no recursion",
    ("hooks.py", '"_old_forward" not in module.__dict__'): "Accelerate's public hook attributes (add_hook_to_module)",
    ("hooks.py", 'module.__dict__.get("_hf_hook")'): "Accelerate's public hook attributes",
    ("hooks.py", 'module.__dict__.pop("_old_forward", None)'): "Accelerate's public hook attributes",
    ("hooks.py", 'module.__dict__.pop("forward", None)'): "Accelerate's public hook attributes",
    ("hooks.py", '"_hf_hook" not in module.__dict__'): "Accelerate's public hook attributes",
    ("utils/other.py", '"_orig_mod" in module.__dict__'):
        "Accelerate's compile_regions convention: the copy keeps the original module in _orig_mod",
    ("utils/other.py", 'module.__dict__["_orig_mod"]'): "Accelerate's compile_regions convention",
    ("utils/other.py", 'compiled.__dict__["_orig_mod"] = model'): "Accelerate's compile_regions convention",
    ("data/dispatch.py", 'self.__dict__.get("sampler")'):
        "DataLoader's own public attribute, absent for some datasets (getattr would hit DataLoader's checks)",
    ("data/loaders.py", '__dict__.get("sampler")'): "DataLoader's own public attribute (as above)",
}


def _accesses() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _ACCESS.search(code):
                found.append((rel, number, code.strip()))
    return found


def test_no_state_is_stashed_in_dict_keys():
    hidden = [f"src/hasten/{rel}:{number}: {code}" for rel, number, code in _accesses()
              if not any(rel == file and fragment in code for file, fragment in ALLOWED)]
    assert not hidden, "state kept in __dict__ keys (declare an attribute in a constructor):\n" + "\n".join(hidden)


def test_the_allow_list_has_no_stale_entries():
    found = _accesses()
    stale = [key for key in ALLOWED if not any(rel == key[0] and key[1] in code for rel, _, code in found)]
    assert not stale, f"allow-list entries that match nothing any more (remove them): {stale}"


def test_no_module_level_cache_between_checkpoint_calls():
    """A load's DCP metadata travels with the load (``sharded.Reader``), not in a module global."""
    text = (SRC / "checkpointing" / "sharded.py").read_text()
    assert "_LAST_METADATA" not in text


# -- the declared replacements behave as the stashes did ----------------------------------------------
def _seen_hook(models, weights, folder):  # module level: picklable with the Accelerator
    pass


def test_checkpoint_session_is_pickled_without_its_background_saver(fresh_state, tmp_path):
    import pickle

    from torch import nn

    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(2, 1))
    handle = acc.register_save_state_pre_hook(_seen_hook)
    acc.save_state(str(tmp_path / "ck"), blocking=False)
    acc.wait_for_checkpoint()
    assert acc._checkpoints.background is not None  # kept for the next save (its staging buffers)
    copy = pickle.loads(pickle.dumps(acc))
    assert copy._checkpoints.background is None and acc._checkpoints.background is not None
    assert list(copy._checkpoints.save_pre_hooks.hooks.values()) == [_seen_hook]
    handle.remove()  # the original's registry only
    assert not acc._checkpoints.save_pre_hooks.hooks and copy._checkpoints.save_pre_hooks.hooks
    acc.free_memory()
    assert acc._checkpoints.background is None


def test_prepared_loaders_call_their_boundary_callbacks(fresh_state):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2))
    positions = []

    def callback(dl):
        positions.append(dl._position)

    loader.add_boundary_callback(callback)
    assert len(list(loader)) == 3 and positions  # called at the boundaries of the pass
    seen = len(positions)
    loader.remove_boundary_callback(callback)
    loader.remove_boundary_callback(callback)  # not there any more: nothing happens
    list(loader)
    assert len(positions) == seen


def test_save_on_preemption_refuses_a_loader_that_was_not_prepared(fresh_state, tmp_path):
    """A plain DataLoader never reaches a boundary, so the handler would never save: an error instead."""
    import pytest
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    plain = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2)
    prepared = acc.prepare(DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2))
    with pytest.raises(ValueError, match="item 1 is a DataLoader, not a prepared dataloader"):
        acc.save_on_preemption(output_dir=str(tmp_path / "ck"), dataloaders=[prepared, plain])


def test_a_sharded_load_reads_the_metadata_once_and_keeps_nothing_after(fresh_state, tmp_path, monkeypatch):
    import torch
    from torch import nn

    from hasten.checkpointing import backends, sharded
    from hasten.files import unpickling

    model = nn.Linear(3, 2)
    sharded.save(str(tmp_path), [model], [], [])
    contents = {"models": [{"dcp": "model_0"}], "optimizers": []}
    reads = []
    read = unpickling.dcp_metadata
    monkeypatch.setattr(unpickling, "dcp_metadata", lambda path, *rest: reads.append(path) or read(path, *rest))
    other = nn.Linear(3, 2)
    reader = backends.reader_for(contents, strategy=None)
    assert isinstance(reader, sharded.Reader) and reader is not backends.reader_for(contents, strategy=None)
    assert reader.check(str(tmp_path), contents, [other], []) == []
    reader.load(str(tmp_path), contents, [other], [])
    assert len(reads) == 1  # the check's read served the load
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert reader.check(str(tmp_path), contents, [other], []) == [] and len(reads) == 2  # the load let go of it


def test_ddp_marks_the_process_progress_through_its_function():
    """``progress.STATE`` is written by ``progress``'s functions only (the heartbeat reads it)."""
    from hasten import progress

    before = progress.STATE.ddp
    try:
        progress.STATE.ddp = False
        progress.ddp_wrapped()
        assert progress.snapshot()["ddp"] is True
    finally:
        progress.STATE.ddp = before
    writers = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
               if p.name != "progress.py" and re.search(r"progress\.STATE\.\w+\s*=[^=]", p.read_text())]
    assert not writers, f"progress.STATE written outside hasten.progress: {writers}"
