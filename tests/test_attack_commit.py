"""Attacks on hasten's own checkpoint folders and faults in their commit (issue 23).

- fsync errors (EIO, ENOSPC) fail the save and commit nothing; "not supported" errnos are ignored;
- a crash before every filesystem step of the commit (with and without an atomic exchange) leaves
  the newest complete checkpoint loadable, and later saves never delete it;
- ``save_on_each_node`` with a sharded backend on several machines is refused before anything changes;
- every file of a folder tampered (bit flips in data and header, truncation, emptying, symlinks,
  path escapes): load_state and resume="auto" refuse with an error naming the file;
- discovery only takes ``checkpoint_<ASCII digits>`` real folders.

The default run samples the grids; ``HASTEN_ATTACK_FULL=1`` runs them whole.
"""

import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from distributed import reset_state

from hasten.checkpointing import layout
from hasten.files.errors import CheckpointCorruptError

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "scripts", "attack_commit_child.py")
FULL = bool(os.environ.get("HASTEN_ATTACK_FULL"))
full_only = pytest.mark.skipif(not FULL, reason="full attack grid: set HASTEN_ATTACK_FULL=1")
ERRORS = (CheckpointCorruptError, layout.IncompleteCheckpointError, layout.CheckpointNotFoundError)


class Counter:
    def __init__(self, value=0.0):
        self.value = value

    def state_dict(self):
        return {"value": self.value, "t": torch.tensor([float(self.value)])}

    def load_state_dict(self, state):
        self.value = state["value"]


def make(project=None, value=1.0, total_limit=None, resume=None, iteration=0):
    from hasten import Accelerator
    from hasten.utils import ProjectConfiguration

    reset_state()
    cfg = None
    if project is not None:
        cfg = ProjectConfiguration(str(project), automatic_checkpoint_naming=True, total_limit=total_limit,
                                   iteration=iteration)
    acc = Accelerator(project_config=cfg, resume=resume)
    counter = Counter(value)
    acc.register_for_checkpointing(counter)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, counter


def weight(model):
    return float(model.weight.detach().flatten()[0])


# -- 1. fsync errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("where", ["data", "dirs", "parent"])
@pytest.mark.parametrize("auto", [True, False])
def test_fsync_errors_fail_the_save_and_commit_nothing(tmp_path, monkeypatch, code, where, auto):
    acc, model, _ = make(tmp_path / "p" if auto else None, value=1.0)
    fixed = None if auto else str(tmp_path / "fixed")
    first = acc.save_state(fixed)
    real = os.fsync

    def failing(fd):  # "data": every file but the manifest (the data files are what a lenient fsync lost)
        import stat

        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        path = os.readlink(f"/proc/self/fd/{fd}")
        manifest = os.path.basename(path).startswith("manifest.json")
        if where == "parent":  # only the rename into place cannot be made durable: it is undone
            hit = path == os.path.dirname(first)
        else:
            hit = is_dir if where == "dirs" else not is_dir and not manifest
        if hit:
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with torch.no_grad():
        model.weight.fill_(5.0)
    with pytest.raises(Exception, match=os.strerror(code)):
        acc.save_state(fixed)
    monkeypatch.setattr(os, "fsync", real)
    layout.wait_for_deletions()
    parent = os.path.dirname(first)
    if auto:
        assert layout.newest_complete(parent) == (0, first)
        assert [n for n, _ in layout.numbered(parent)] == [0]
    assert not [n for n in os.listdir(parent) if n.startswith(".") and layout.is_complete(os.path.join(parent, n))]
    acc.load_state(first)
    assert weight(model) == 1.0


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP, errno.ENOSYS])
def test_fsync_not_supported_is_ignored(tmp_path, monkeypatch, code):
    acc, model, _ = make(tmp_path / "p", value=2.0)

    def refuse(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", refuse)
    folder = acc.save_state()
    monkeypatch.undo()
    acc.load_state(folder)
    assert weight(model) == 2.0


# -- 2. crashes at every step of the commit ----------------------------------------------------------------
def _crash(project, mode, exchange, k, value):
    proc = subprocess.run([sys.executable, CHILD, "crash", str(project), mode, "1" if exchange else "0", str(k),
                           str(value)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode in (0, 17), proc.stderr[-3000:]
    return proc.returncode == 0


def _prepare(project, mode):
    """Checkpoints of values 1 and 2 (auto: checkpoint_1, checkpoint_2; replace: ckpt holding 2)."""
    for value in (1.0, 2.0):
        acc, _, _ = make(project if mode == "auto" else None, value=value, total_limit=2, iteration=int(value))
        acc.save_state(None if mode == "auto" else str(project / "ckpt"))
    layout.wait_for_deletions()


def _check_after_crash(project, mode, crashed_value):
    """A fresh Accelerator loads the newest complete checkpoint: the old one (2) or the new one."""
    acc, model, _ = make(project if mode == "auto" else None, value=0.0, total_limit=2)
    folder = acc.load_state(None if mode == "auto" else str(project / "ckpt"))
    loaded = weight(model)
    assert loaded in (2.0, crashed_value), (folder, loaded)
    if mode == "auto":
        assert os.path.basename(folder) == f"checkpoint_{int(loaded)}"
    # the next save keeps the newest: loading afterwards gives that save, and the one before survives
    with torch.no_grad():
        model.weight.fill_(9.0)
    acc.save_state(None if mode == "auto" else str(project / "ckpt"))
    layout.wait_for_deletions()
    acc2, model2, _ = make(project if mode == "auto" else None, value=0.0, total_limit=2)
    acc2.load_state(None if mode == "auto" else str(project / "ckpt"))
    assert weight(model2) == 9.0
    if mode == "auto":
        complete = [n for n, p in layout.numbered(layout.auto_root(str(project))) if layout.is_complete(p)]
        assert int(loaded) in complete, complete
    return loaded


def _crash_points(tmp_path, mode, exchange, points):
    for k in points:
        project = tmp_path / f"{mode}-{int(exchange)}-{k}"
        project.mkdir()
        _prepare(project, mode)
        finished = _crash(project, mode, exchange, k, 3.0)
        _check_after_crash(project, mode, 3.0)
        if finished:
            return k
    return None


@pytest.mark.parametrize("mode,exchange,points", [("replace", False, [2]), ("auto", True, [1])])
def test_crash_between_commit_steps_sampled(tmp_path, mode, exchange, points):
    _crash_points(tmp_path, mode, exchange, points)


@full_only
@pytest.mark.parametrize("mode", ["replace", "auto"])
@pytest.mark.parametrize("exchange", [True, False])
def test_crash_at_every_commit_step(tmp_path, mode, exchange):
    assert _crash_points(tmp_path, mode, exchange, range(40)) is not None


def test_hidden_complete_checkpoints_are_recovered_not_deleted(tmp_path):
    """The state a crash between the two renames leaves: both checkpoints under hidden names."""
    acc, model, _ = make(None, value=4.0)
    target = str(tmp_path / "ckpt")
    acc.save_state(target)
    new = layout.temp_path(target, layout.new_token())
    shutil.copytree(target, new)
    os.rename(target, layout.temp_path(target, layout.new_token(), "old"))
    acc, model, _ = make(None, value=0.0)
    assert acc.load_state(target) == target
    assert weight(model) == 4.0
    # the next save replaces it and leaves one checkpoint (the leftovers of the crash are cleaned)
    acc, model, _ = make(None, value=5.0)
    acc.save_state(target)
    layout.wait_for_deletions()  # the replaced checkpoint is renamed hidden, then deleted on a thread
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    acc, model, _ = make(None, value=0.0)
    acc.load_state(target)
    assert weight(model) == 5.0
    # a save that never reached its rename (crash after its manifest) is not committed: not resumed from
    acc, model, _ = make(tmp_path / "p", value=6.0, total_limit=2)
    first = acc.save_state()
    with torch.no_grad():
        model.weight.fill_(7.0)
    second = acc.save_state()
    os.rename(second, layout.temp_path(second, layout.new_token()))
    acc, model, _ = make(tmp_path / "p", value=0.0, total_limit=2, resume="auto")
    assert weight(model) == 6.0
    assert acc.save_state() == second  # numbered after the committed one; the leftover is cleaned
    layout.wait_for_deletions()
    root = layout.auto_root(str(tmp_path / "p"))
    assert [n for n, p in layout.numbered(root)] == [0, 1] and first.endswith("checkpoint_0")
    assert not [n for n in os.listdir(root) if n.startswith(".")]


# -- 3. save_on_each_node with a sharded backend -------------------------------------------------------------
def _two(args, env_extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", HASTEN_USE_CPU="1", **env_extra(rank))
        procs.append(subprocess.Popen([sys.executable, CHILD, *args(rank)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return [p.communicate(timeout=240)[0] for p in procs]


def test_save_on_each_node_with_sharded_backend_is_refused_up_front(tmp_path):
    project = tmp_path / "p"
    root = project / "checkpoints" / "checkpoint_0"
    root.mkdir(parents=True)
    (root / "keep.txt").write_text("older checkpoint")
    logs = _two(lambda r: ["nodes", str(project), str(tmp_path / f"r{r}.json")],
                lambda r: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    results = []
    for r in range(2):
        assert (tmp_path / f"r{r}.json").exists(), logs[r][-3000:]
        results.append(json.loads((tmp_path / f"r{r}.json").read_text()))
    assert [r["num_machines"] for r in results] == [2, 2]
    assert results[0]["error"] and results[0]["error"] == results[1]["error"]
    assert "save_on_each_node" in results[0]["error"]
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_0"]  # nothing written, nothing deleted


# -- 4. 5. 7. tampered files -----------------------------------------------------------------------------
def _flip(path, where):
    data = bytearray(open(path, "rb").read())
    if where == "header":
        i = 12 if len(data) > 12 else 0
    else:
        i = len(data) - 3
    data[i] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)


ATTACKS = ["flip-data", "flip-header", "truncate", "empty", "symlink"]


def _attack(folder, name, attack, outside):
    path = os.path.join(folder, name)
    if attack.startswith("flip"):
        _flip(path, attack.split("-")[1])
    elif attack == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    elif attack == "empty":
        os.truncate(path, 0)
    elif attack == "symlink":  # same bytes, but a link (here to a copy outside the folder)
        shutil.copy(path, outside)
        os.remove(path)
        os.symlink(outside, path)


def _grid():
    files = ["manifest.json", "model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
             "rank_0.safetensors", "custom_checkpoint_0.safetensors"]
    cases = [(f, a) for f in files for a in ATTACKS]
    sample = [("manifest.json", "flip-data"), ("model.safetensors", "flip-data"),
              ("optimizer.safetensors", "flip-header"), ("rank_0.safetensors", "truncate"),
              ("custom_checkpoint_0.safetensors", "empty"), ("scheduler.safetensors", "symlink")]
    return [pytest.param(f, a, marks=[] if (f, a) in sample else [full_only]) for f, a in cases]


@pytest.mark.parametrize("name,attack", _grid())
def test_tampered_file_is_refused_naming_it(tmp_path, name, attack):
    acc, model, counter = make(tmp_path / "p", value=3.0)
    folder = acc.save_state()
    _attack(folder, name, attack, str(tmp_path / "outside"))
    acc, model, counter = make(None, value=0.0)
    with pytest.raises(ERRORS) as info:
        acc.load_state(folder)
    assert name in str(info.value), str(info.value)
    assert weight(model) == 0.0 and counter.value == 0.0  # nothing changed
    # resume="auto" never loads it: it refuses naming the file, or passes over it with a warning naming it
    with pytest.warns(UserWarning) as seen:
        try:
            _, model, counter = make(tmp_path / "p", value=0.0, resume="auto")
        except ERRORS as e:
            assert name in str(e), str(e)
            warnings.warn("refused")
        else:
            assert weight(model) == 0.0 and counter.value == 0.0
            assert any(name in str(w.message) for w in seen), [str(w.message) for w in seen]


def _rewrite_manifest(folder, change):
    path = os.path.join(folder, "manifest.json")
    manifest = json.load(open(path))
    change(manifest)
    manifest.pop(layout.CHECKSUM_KEY, None)  # recomputed as an attacker would (SHA-256 of the canonical JSON)
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    manifest[layout.CHECKSUM_KEY] = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    json.dump(manifest, open(path, "w"))


def test_damaged_manifest_is_blamed_not_the_files(tmp_path):
    acc, _, _ = make(None, value=3.0)
    folder = acc.save_state(str(tmp_path / "c"))
    path = os.path.join(folder, "manifest.json")
    text = open(path).read()
    open(path, "w").write(text.replace('"optimizer.safetensors"', '"optymizer.safetensors"', 1))
    acc, _, _ = make(None, value=0.0)
    with pytest.raises(CheckpointCorruptError, match="manifest.json.*damaged"):
        acc.load_state(folder)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/hostname", "sub/../../x", "link.safetensors"])
def test_manifest_paths_that_escape_or_are_symlinks_are_refused(tmp_path, escape):
    acc, model, _ = make(None, value=3.0)
    folder = acc.save_state(str(tmp_path / "c"))
    shutil.copy(os.path.join(folder, "model.safetensors"), tmp_path / "outside.safetensors")
    if escape == "link.safetensors":
        os.symlink("model.safetensors", os.path.join(folder, escape))

    def change(manifest):
        manifest["files"][escape] = manifest["files"].pop("model.safetensors")
        manifest["contents"]["models"][0]["file"] = escape

    _rewrite_manifest(folder, change)
    acc, model, _ = make(None, value=0.0)
    with pytest.raises(ERRORS, match="outside|symbolic link"):
        acc.load_state(folder)
    assert weight(model) == 0.0


def test_flipped_byte_fails_load_state_and_resume_auto_by_default(tmp_path):
    acc, model, _ = make(tmp_path / "p", value=3.0)
    folder = acc.save_state()
    _flip(os.path.join(folder, "optimizer.safetensors"), "data")
    acc, model, _ = make(None, value=0.0)
    with pytest.raises(CheckpointCorruptError, match="optimizer.safetensors"):
        acc.load_state(folder)
    with pytest.raises(Exception, match="optimizer.safetensors"):
        make(tmp_path / "p", value=0.0, resume="auto")


def test_two_processes_raise_the_same_error(tmp_path):
    acc, _, _ = make(None, value=3.0)
    folder = acc.save_state(str(tmp_path / "c"))
    _flip(os.path.join(folder, "model.safetensors"), "data")
    reset_state()
    logs = _two(lambda r: ["agree", folder, str(tmp_path / f"r{r}.json")],
                lambda r: {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"})
    errors = []
    for r in range(2):
        assert (tmp_path / f"r{r}.json").exists(), logs[r][-3000:]
        errors.append(json.loads((tmp_path / f"r{r}.json").read_text())["error"])
    assert errors[0] and errors[0] == errors[1] and "model.safetensors" in errors[0], errors


# -- 6. discovery ---------------------------------------------------------------------------------------
def test_discovery_takes_only_names_hasten_writes(tmp_path):
    acc, model, _ = make(tmp_path / "p", value=1.0, total_limit=1)
    first = acc.save_state()
    root = layout.auto_root(str(tmp_path / "p"))
    elsewhere = tmp_path / "elsewhere"
    acc2, _, _ = make(None, value=7.0)
    acc2.save_state(str(elsewhere))
    for name in ("checkpoint_\u0669", "checkpoint_07", "checkpoint_\uff18"):
        shutil.copytree(elsewhere, os.path.join(root, name))
    os.symlink(elsewhere, os.path.join(root, "checkpoint_9"))
    assert layout.numbered(root) == [(0, first)]
    assert layout.next_number(root, 0) == 10  # a name in use is never written over, link or not
    acc, model, _ = make(tmp_path / "p", value=0.0, total_limit=1, resume="auto")
    assert weight(model) == 1.0
    acc.save_state()  # retention (total_limit=1) must not delete through the link
    layout.wait_for_deletions()
    assert layout.is_complete(str(elsewhere)) and os.path.islink(os.path.join(root, "checkpoint_9"))
    assert os.path.isdir(os.path.join(root, "checkpoint_\u0669"))
    # nor delete another library's checkpoint_N (an Accelerate folder, say) however many there are
    os.makedirs(os.path.join(root, "checkpoint_0"))  # retention deleted hasten's checkpoint_0
    open(os.path.join(root, "checkpoint_0", "model.safetensors"), "wb").close()
    acc.save_state()
    acc.save_state()
    layout.wait_for_deletions()
    assert os.path.exists(os.path.join(root, "checkpoint_0", "model.safetensors"))
    assert [n for n, p in layout.numbered(root) if layout.is_complete(p)] == [12]
    # loading the link explicitly is refused, not followed
    with pytest.raises(ERRORS, match="symbolic link"):
        acc.load_state(os.path.join(root, "checkpoint_9"))


@pytest.mark.parametrize("change", ["no contents", "world_size text", "scheduler file unknown", "file checksum null"])
def test_crafted_manifest_with_a_valid_checksum_is_refused_naming_it(tmp_path, change):
    acc, model, _ = make(None, value=3.0)
    folder = acc.save_state(str(tmp_path / "c"))

    def edit(manifest):
        if change == "no contents":
            del manifest["contents"]
        elif change == "world_size text":
            manifest["world_size"] = "2"
        elif change == "file checksum null":  # would let that file load unverified
            manifest["files"]["model.safetensors"]["checksum"] = None
        else:
            manifest["contents"]["schedulers"][0]["file"] = "elsewhere.safetensors"

    _rewrite_manifest(folder, edit)
    acc, model, _ = make(None, value=0.0)
    with pytest.raises(CheckpointCorruptError, match="manifest.json.*damaged or crafted"):
        acc.load_state(folder)
    assert weight(model) == 0.0


def test_resume_from_a_folder_a_crash_hid_recovers_it(tmp_path):
    acc, model, _ = make(None, value=4.0)
    target = str(tmp_path / "ckpt")
    acc.save_state(target)
    os.rename(target, layout.temp_path(target, layout.new_token(), "old"))  # a crash between the two renames
    _, model, counter = make(None, value=0.0, resume=target)
    assert weight(model) == 4.0 and counter.value == 4.0


def test_a_version_1_manifest_without_its_own_checksum_still_loads(tmp_path):
    """Checkpoints written before the manifest had a checksum keep loading (and resuming)."""
    acc, model, _ = make(tmp_path / "p", value=4.0)
    folder = acc.save_state()
    path = os.path.join(folder, "manifest.json")
    manifest = json.load(open(path))
    del manifest[layout.CHECKSUM_KEY]
    manifest["format_version"] = 1
    json.dump(manifest, open(path, "w"))
    _, model, counter = make(tmp_path / "p", value=0.0, resume="auto")
    assert weight(model) == 4.0 and counter.value == 4.0
    manifest["format_version"] = 2  # a version 2 manifest must carry it
    json.dump(manifest, open(path, "w"))
    acc, model, _ = make(None, value=0.0)
    with pytest.raises(CheckpointCorruptError, match="manifest.json.*no checksum of its own"):
        acc.load_state(folder)
