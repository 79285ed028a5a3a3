"""``save_state`` called by process 0 only (diffusers' ``if accelerator.is_main_process:``) and the
moment the random generators are recorded (after the save hooks, as Accelerate). The 2-process
checks are in checks_save_one_process.py; a hang fails them through run_checks' timeout."""

import os
import random
import warnings

import numpy as np
import pytest
import torch

from distributed import run_checks


@pytest.fixture(scope="module")
def two():
    # Before process 0 could save alone, the first check hung: the timeout turns that into a failure.
    return run_checks("checks_save_one_process", world_size=2, timeout=300)


def test_ddp_save_by_process_0_only_commits_and_loads_on_two_processes(two):
    values = two.assert_passed("check_ddp_main_only_save_then_load")
    main, other = values
    assert main["saved_to"] == main["folder"] and other["saved_to"] is None
    assert main["elapsed"] < 30, main["elapsed"]
    # Only process 0's files: nothing of process 1 (as Accelerate writes only random_states_0.pkl).
    assert main["names"] == ["manifest.json", "model.safetensors", "optimizer.safetensors", "rank_0.safetensors"]
    assert main["weights"] and other["weights"]
    assert main["same_batch"] and other["same_batch"]  # process 1 continues from process 0's position
    assert main["rng_exact"] and main["notes"] == []
    assert len(other["notes"]) == 1 and "holds no state of process 1" in other["notes"][0]
    assert "random generators stay as they are" in other["notes"][0]


def test_ddp_save_by_process_0_only_loads_in_one_process(two, fresh_state):
    from checks_save_one_process import _run

    saved = two.assert_passed("check_ddp_main_only_save_then_load")[0]
    acc, model, opt, loader = _run(hook=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(saved["folder"])
    messages = [str(w.message) for w in caught]
    got = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(got[k], torch.tensor(v, device=got[k].device)) for k, v in saved["expected"].items())
    assert not any("holds no state" in m for m in messages), messages
    assert any("saved by 2 processes and is resumed by 1" in m for m in messages), messages


@pytest.mark.parametrize("name", ["check_ddp_every_process_save_resumes_exactly",
                                  "check_ddp_every_process_background_save_resumes_exactly"])
def test_every_process_save_resumes_exactly_on_two_processes(two, name):
    """Saved mid-window (partial gradients) with a hook drawing random numbers: process 1's files are
    attached to the checkpoint process 0 committed, and the resume is exact on both processes."""
    for value in two.assert_passed(name):
        assert value == {"draws": True, "batches": True, "worst": 0.0,
                         "listed": ["grads_rank_0.safetensors", "rank_0.safetensors"],
                         "attached": ["attached_rank_1.json"],
                         # each process's hook file: process 0's in the manifest, process 1's attached
                         "hook_files": {"manifest": ["extra/from_0.txt"], "attachment": ["extra/from_1.txt"],
                                        "on_disk": ["from_0.txt", "from_1.txt"]},
                         "hidden": []}, value


def test_damaged_attachments_are_named_on_every_process(two):
    values = two.assert_passed("check_attachment_damage_is_named")
    assert values[0] == values[1]
    seen = values[0]["seen"]
    expected = {
        "record_flip": ("attached_rank_1.json' is damaged or crafted: its checksum", "CheckpointCorruptError"),
        "record_truncated": ("attached_rank_1.json' is damaged: it cannot be read as JSON", "CheckpointCorruptError"),
        "record_swapped": ("attached_rank_1.json' is damaged or crafted: it belongs to another save",
                           "CheckpointCorruptError"),
        "record_link": ("attached_rank_1.json' is a symbolic link", "CheckpointCorruptError"),
        "rank_file_flip": ("rank_1.safetensors' is corrupted: checksum", "CheckpointCorruptError"),
        "rank_file_truncated": ("rank_1.safetensors' has", "CheckpointCorruptError"),
        "rank_file_swapped": ("rank_1.safetensors' is corrupted: checksum", "CheckpointCorruptError"),
        "grads_flip": ("grads_rank_1.safetensors' is corrupted: checksum", "CheckpointCorruptError"),
        "rank_file_link": ("names 'rank_1.safetensors' (rank_1.safetensors is a symbolic link)",
                           "CheckpointCorruptError"),
    }
    assert set(seen) == set(expected)
    for label, (fragment, kind) in expected.items():
        assert seen[label].startswith(kind + ": ") and fragment in seen[label], (label, seen[label])
        assert f"/{label}/" in seen[label] and "process 1:" in seen[label], (label, seen[label])
    assert values[0]["untouched"]


@pytest.mark.parametrize("name, cause", [
    ("check_fsdp2_main_only_save_is_one_clear_error", "this run's state is sharded"),
    ("check_automatic_naming_main_only_save_is_one_clear_error", "automatic_checkpoint_naming=True"),
])
def test_save_by_process_0_only_where_every_process_must_save_is_one_clear_error(two, name, cause):
    """The arrival check waits the hang timeout (4 s here) for process 1, then raises on process 0,
    before any collective: process 1 is not left waiting, and a later save by every process works."""
    main, other = two.assert_passed(name)
    error, elapsed = main["outcome"]["error"], main["outcome"]["elapsed"]
    assert error is not None and error.startswith("save_state on process 0: process 1 did not call save_state "
                                                  "within 4 s (the hang timeout)"), error
    assert cause in error and "Call accelerator.save_state(...) on every process" in error, error
    assert 3.9 < elapsed < 30, elapsed
    assert main["later"] and other["later"] and other["outcome"] is None


# -- the moment the generators are recorded ----------------------------------------------------------------
def _hooked_run(project):
    from checks_save_one_process import _drawing_hook

    from hasten import Accelerator

    acc = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.register_save_state_pre_hook(_drawing_hook)
    return acc, model, opt


def _steps(acc, model, opt, n):
    draws = []
    for _ in range(n):
        x = torch.randn(4, 4, device=acc.device)  # drawn from the generators the checkpoint restores
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        draws.append([torch.rand(1).item(), random.random(), float(np.random.rand())])
    return draws


@pytest.mark.parametrize("automatic", [False, True])
@pytest.mark.parametrize("blocking", [True, False])
def test_generators_are_recorded_after_the_save_hooks(tmp_path, fresh_state, automatic, blocking):
    """A save hook that draws from torch, random and NumPy: the resumed run's draws and weights equal the
    uninterrupted run's (which ran the hook too), as with Accelerate. Recorded before the hooks, the
    resumed run repeated the hook's draws."""
    from distributed import reset_state

    from hasten.utils import ProjectConfiguration

    project = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=automatic)
    acc, model, opt = _hooked_run(project)
    _steps(acc, model, opt, 2)
    folder = acc.save_state(None if automatic else str(tmp_path / "ckpt"), blocking=blocking)
    expected_draws = _steps(acc, model, opt, 3)
    acc.wait_for_checkpoint()
    expected = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    reset_state()
    random.seed(123)  # the resumed run starts from other generator states
    np.random.seed(123)
    torch.manual_seed(123)
    acc, model, opt = _hooked_run(ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=automatic))
    acc.load_state(folder)
    assert _steps(acc, model, opt, 3) == expected_draws
    got = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert os.path.isdir(folder)


def test_a_failure_of_process_0_reaches_the_other_processes(two):
    main, other = two.assert_passed("check_a_failure_of_process_0_is_raised_on_every_process")
    assert main["error"].startswith("ValueError: save_state: output_dir=") and "is a file" in main["error"], main
    assert other["error"].startswith("RuntimeError: save_state failed on process 0; nothing was committed: "
                                     "ValueError: save_state: output_dir="), other
    assert other["elapsed"] < 30, other
