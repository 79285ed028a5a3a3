"""resume="auto" never starts over (or falls back past a committed checkpoint) silently; resume="auto-skip-damaged"
is the explicit way to pass over checkpoints that no longer load."""

import os
import warnings

import pytest
import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.checkpointing import layout
from hasten.utils import ProjectConfiguration


def _run(project, value, resume=None):
    """A run whose weight is filled with ``value``, resuming as asked; returns (accelerator, model)."""
    reset_state()
    acc = Accelerator(project_config=ProjectConfiguration(str(project), automatic_checkpoint_naming=True),
                      resume=resume)
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model


def _weight(acc, model):
    return acc.unwrap_model(model).weight.flatten()[0].item()


def _saved(project, values):
    """Checkpoints checkpoint_0.. holding the weights ``values``."""
    folders = []
    for value in values:
        acc, model = _run(project, value)
        acc.project_configuration.iteration = len(folders)
        folders.append(acc.save_state())
    reset_state()
    return folders


def _damage_manifest(folder):
    path = os.path.join(folder, "manifest.json")
    text = open(path).read()
    open(path, "w").write(text.replace('"iteration"', '"iteratiom"', 1))  # committed, then damaged


def _damage_file(folder):
    path = os.path.join(folder, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))


def _resume(project, resume):
    """(error message or None, weight after prepare, warnings)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            acc, model = _run(project, -1.0, resume)
        except Exception as e:  # noqa: BLE001 - the test judges the message
            return str(e), None, [str(w.message) for w in seen]
    return None, _weight(acc, model), [str(w.message) for w in seen]


def test_a_damaged_only_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    (folder,) = _saved(tmp_path, [1.0])
    _damage_manifest(folder)
    error, weight, _ = _resume(tmp_path, "auto")
    assert error is not None, f"resume='auto' started from scratch (weight {weight})"
    assert folder in error and "manifest.json" in error and "auto-skip-damaged" in error, error
    error, weight, seen = _resume(tmp_path, "auto-skip-damaged")
    assert error is None and weight == -1.0 and any(folder in w for w in seen), (error, weight, seen)


def test_folders_none_of_which_loads_are_an_error(tmp_path):
    (folder,) = _saved(tmp_path, [1.0])
    os.remove(os.path.join(folder, "manifest.json"))  # a save that never committed, or another library's folder
    error, weight, _ = _resume(tmp_path, "auto")
    assert error is not None and folder in error and "none of them can be loaded" in error, (error, weight)
    assert "no manifest.json" in error, error


def test_a_newer_committed_checkpoint_that_is_damaged_is_an_error(tmp_path):
    old, new = _saved(tmp_path, [1.0, 2.0])
    _damage_manifest(new)
    error, weight, _ = _resume(tmp_path, "auto")
    assert error is not None, f"resume='auto' fell back to an older checkpoint (weight {weight})"
    assert new in error and "committed but cannot be loaded" in error and old in error, error
    error, weight, seen = _resume(tmp_path, "auto-skip-damaged")
    assert error is None and weight == 1.0 and any(new in w for w in seen), (error, weight, seen)


def test_a_newer_committed_checkpoint_with_a_damaged_file(tmp_path):
    old, new = _saved(tmp_path, [1.0, 2.0])
    _damage_file(new)
    error, _, _ = _resume(tmp_path, "auto")  # the loader's own error, naming the file
    assert error is not None and "model.safetensors" in error and new in error, error
    error, weight, seen = _resume(tmp_path, "auto-skip-damaged")  # nothing changed by the failed load: the older one
    assert error is None and weight == 1.0, (error, weight, seen)
    assert any(new in w and "model.safetensors" in w for w in seen), seen


def test_a_newer_save_that_never_committed_is_passed_over_with_a_warning(tmp_path):
    old, new = _saved(tmp_path, [1.0, 2.0])
    os.remove(os.path.join(new, "manifest.json"))
    error, weight, seen = _resume(tmp_path, "auto")
    assert error is None and weight == 1.0 and any(new in w for w in seen), (error, weight, seen)


def test_no_checkpoint_starts_fresh(tmp_path):
    for resume in ("auto", "auto-skip-damaged"):
        error, weight, _ = _resume(tmp_path / resume, resume)
        assert error is None and weight == -1.0, (resume, error, weight)


def test_an_unknown_resume_value_names_the_choices():
    with pytest.raises(ValueError, match="auto-skip-damaged"):
        _run("unused", 0.0, resume=3)
    reset_state()
    assert layout.MANIFEST == "manifest.json"


def _load_latest(project):
    """load_state() without a folder into a fresh run: (error message or None, weight, warnings)."""
    acc, model = _run(project, -1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            acc.load_state()
        except Exception as e:  # noqa: BLE001 - the test judges the message
            return f"{type(e).__name__}: {e}", None, [str(w.message) for w in seen]
    return None, _weight(acc, model), [str(w.message) for w in seen]


def test_load_state_without_a_folder_follows_the_same_rule(tmp_path):
    """load_state() picks its checkpoint as resume='auto' does: a newer committed checkpoint that is damaged is
    an error naming it (it used to fall back to the older one with only a warning)."""
    old, new = _saved(tmp_path, [1.0, 2.0])
    _damage_manifest(new)
    error, weight, _ = _load_latest(tmp_path)
    assert error is not None, f"load_state() fell back to an older checkpoint (weight {weight})"
    assert error.startswith("IncompleteCheckpointError") and new in error and old in error, error
    assert "committed but cannot be loaded" in error and "load_state(folder)" in error, error


def test_load_state_without_a_folder_passes_over_a_save_that_never_committed(tmp_path):
    old, new = _saved(tmp_path, [1.0, 2.0])
    os.remove(os.path.join(new, "manifest.json"))
    error, weight, seen = _load_latest(tmp_path)
    assert error is None and weight == 1.0 and any(new in w for w in seen), (error, weight, seen)
