"""save_state / load_state in one process: formats, naming, retention, discovery, verification,
mismatch errors, pickle safety, hooks, resume="auto", seeking. (Multi-process behaviour: the
checks_checkpoint / test_checkpoint_resume / test_checkpoint_recovery modules.)"""

import json
import math
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from devices import reference_device
from distributed import reset_state
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from hasten.checkpointing import codec, layout
from hasten.files.checksum import BlockSummer, checksum_buffer
from hasten.files.errors import CheckpointCorruptError
from hasten.files.safetensors_format import write_safetensors
from hasten.files.reading import read_path
from hasten.saving import CheckpointMismatchError


class Tied(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, hidden)
        self.out = nn.Linear(hidden, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(3))

    def forward(self, idx):
        return self.head(self.out(torch.tanh(self.body(self.embed(idx)))))


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value, "history": [self.value] * 2, "t": torch.tensor([float(self.value)])}

    def load_state_dict(self, state):
        self.value = state["value"]


class Opaque:
    """A registered object whose state only pickle can store."""

    def __init__(self):
        self.thing = Counter(5)

    def state_dict(self):
        return {"thing": self.thing}

    def load_state_dict(self, state):
        self.thing = state["thing"]


def setup(project=None, hidden=8, auto=True, total_limit=None, resume=None, **kw):
    from hasten import Accelerator
    from hasten.utils import ProjectConfiguration

    torch.manual_seed(0)
    cfg = ProjectConfiguration(project, automatic_checkpoint_naming=auto, total_limit=total_limit) if project else None
    acc = Accelerator(project_config=cfg, resume=resume, **kw)
    model = Tied(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def train_step(model, opt, sched):
    loss = model(torch.arange(6, device=reference_device())).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def snapshot(model, opt):
    state = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, entries in opt.state_dict()["state"].items():
        state.update({f"o.{pid}.{k}": v.clone() for k, v in entries.items() if torch.is_tensor(v)})
    return state


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- formats -----------------------------------------------------------------------------------------
def test_codec_round_trip_without_pickle():
    state = {"a": 1, "b": [1.5, float("inf"), None, True, "s"], 3: (1, (2, 3)), "n": {"x": torch.arange(3)},
             "np": np.arange(4, dtype=np.float32), "scalar": np.float64(2.5), "dtype": torch.bfloat16,
             "dev": torch.device("cpu"), "__hasten_tuple": "not a tag", "nan": float("nan")}
    skeleton, tensors = codec.encode(state)
    json.dumps(skeleton, allow_nan=False)  # strict JSON
    back = codec.decode(json.loads(json.dumps(skeleton)), tensors)
    assert back["a"] == 1 and back["b"] == [1.5, math.inf, None, True, "s"] and back[3] == (1, (2, 3))
    assert torch.equal(back["n"]["x"], torch.arange(3)) and back["dtype"] is torch.bfloat16
    assert isinstance(back["np"], np.ndarray) and back["np"].tolist() == [0, 1, 2, 3]
    assert isinstance(back["scalar"], np.float64) and back["scalar"] == 2.5
    assert back["__hasten_tuple"] == "not a tag" and math.isnan(back["nan"]) and back["dev"] == torch.device("cpu")
    with pytest.raises(codec.NotEncodable, match=r"state\['obj'\].*Counter"):
        codec.encode({"obj": Counter()})


def test_files_are_plain_safetensors_and_checksums_match(tmp_path):
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    tensors = {"f32": base, "view": base[:, 1:3], "t": base.t(), "bf16": torch.randn(3, 5).bfloat16(),
               "bool": torch.tensor([True, False, True]), "i8": torch.arange(7, dtype=torch.int8),
               "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 3)}
    path = str(tmp_path / "x.safetensors")
    size, checksum = write_safetensors(path, tensors, {"k": "v"})
    assert os.path.getsize(path) == size
    loaded = load_file(path)  # the real safetensors library reads our files
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k].contiguous()) for k in tensors)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v"}
    assert checksum_buffer(read_path(path).raw) == checksum
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 1  # one flipped bit
    corrupt = tmp_path / "y.safetensors"
    corrupt.write_bytes(bytes(data))
    assert checksum_buffer(read_path(str(corrupt)).raw) != checksum


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(37 + i, 53, generator=g) for i in range(5)}
    tensors.update(b=torch.randn(3).bfloat16(), i=torch.arange(11, dtype=torch.int16), empty=torch.zeros(0))
    return tensors


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")
def test_direct_writes_equal_buffered_writes(tmp_path, monkeypatch):
    from hasten.files import safetensors_format as fileio

    # Small buffers and threshold: many buffer flushes, pieces across buffer borders, a padded tail.
    monkeypatch.setattr(fileio, "_DIRECT_MIN", 1)
    monkeypatch.setattr(fileio, "_DIRECT_BUFFER", 2 * fileio._ALIGN)
    monkeypatch.setattr(fileio, "_NO_DIRECT", set())
    tensors = _mixed_tensors()
    direct = write_safetensors(str(tmp_path / "direct.safetensors"), tensors, {"k": "v"})
    if fileio._NO_DIRECT:
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    monkeypatch.setattr(fileio, "_DIRECT_MIN", 1 << 62)
    buffered = write_safetensors(str(tmp_path / "buffered.safetensors"), tensors, {"k": "v"})
    assert direct == buffered and direct[0] % fileio._ALIGN  # same size and checksum; size not aligned
    assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
    loaded = load_file(str(tmp_path / "direct.safetensors"))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")
def test_a_filesystem_refusing_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    from hasten.files import safetensors_format as fileio

    tensors = _mixed_tensors()
    monkeypatch.setattr(fileio, "_DIRECT_MIN", 1 << 62)
    buffered = write_safetensors(str(tmp_path / "buffered.safetensors"), tensors, {"k": "v"})
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio, "_DIRECT_MIN", 1)
    monkeypatch.setattr(fileio, "_NO_DIRECT", set())
    monkeypatch.setattr(os, "open", refusing_open)
    assert write_safetensors(str(tmp_path / "fallback.safetensors"), tensors, {"k": "v"}) == buffered
    assert (tmp_path / "fallback.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
    assert fileio._NO_DIRECT == {os.stat(tmp_path).st_dev}


@pytest.mark.parametrize("seed", range(5))
def test_incremental_checksum_equals_whole_file_checksum(seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (int(torch.randint(1, 20000, (1,), generator=g)),), dtype=torch.uint8, generator=g)
    summer, pos = BlockSummer(), 0
    while pos < data.numel():
        step = int(torch.randint(1, 5000, (1,), generator=g))
        piece = data[pos:pos + step]
        summer.update(piece if step % 2 else bytes(piece.numpy().tobytes()))
        pos += step
    assert summer.digest() == checksum_buffer(data)


# -- naming, retention, discovery ------------------------------------------------------------------------
def test_automatic_naming_retention_and_numbering_after_load(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path, total_limit=2)
    paths = []
    for _ in range(4):
        train_step(model, opt, sched)
        paths.append(acc.save_state())
    root = tmp_path / "checkpoints"
    assert [os.path.basename(p) for p in paths] == [f"checkpoint_{i}" for i in range(4)]
    layout.wait_for_deletions()
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]  # the newest kept, nothing else left
    expected = snapshot(model, opt)
    reset_state()
    acc, model, opt, sched = setup(tmp_path, total_limit=2)  # a new run: iteration starts at 0 again
    assert acc.load_state() == str(root / "checkpoint_3")
    assert same(snapshot(model, opt), expected) and sched.get_last_lr() == [0.1 * 0.5 ** 4]
    assert acc.save_iteration == 4
    assert os.path.basename(acc.save_state()) == "checkpoint_4"  # never collides with an existing one


def test_damaged_newer_checkpoints_are_named_and_incomplete_ones_refused(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)
    train_step(model, opt, sched)
    good = acc.save_state()
    expected = snapshot(model, opt)
    train_step(model, opt, sched)
    root = tmp_path / "checkpoints"
    # newer, but incomplete in every way a crash (or a user) can leave one
    broken = {}
    for number, damage in ((5, "no manifest"), (6, "truncated"), (7, "missing file"), (8, "version")):
        path = root / f"checkpoint_{number}"
        shutil.copytree(good, path)
        if damage == "no manifest":
            os.remove(path / "manifest.json")
        elif damage == "truncated":
            with open(path / "model.safetensors", "r+b") as f:
                f.truncate(100)
        elif damage == "missing file":
            os.remove(path / "rank_0.safetensors")
        else:
            manifest = json.loads((path / "manifest.json").read_text())
            manifest["format_version"] = 99
            (path / "manifest.json").write_text(json.dumps(manifest))
        broken[damage] = path
    (root / ".checkpoint_9.tmp-0123456789abcdef0123456789abcdef").mkdir()
    assert layout.newest_complete(str(root))[1] == good
    # committed-but-damaged newer checkpoints are not passed over in silence: the error names each one
    with pytest.raises(layout.IncompleteCheckpointError, match="(?s)checkpoint_8.*checkpoint_7.*checkpoint_6") as caught:
        acc.load_state()
    assert "checkpoint_5" not in str(caught.value)  # never committed (no manifest): passed over with a warning
    assert acc.load_state(good) == good and same(snapshot(model, opt), expected)
    train_step(model, opt, sched)
    before = snapshot(model, opt)
    for damage, words in (("no manifest", "no manifest.json"), ("truncated", "wrong size"),
                          ("missing file", "missing files: rank_0"), ("version", "version 99")):
        with pytest.raises(layout.IncompleteCheckpointError, match=words):
            acc.load_state(broken[damage])
        assert same(snapshot(model, opt), before)
    assert os.path.basename(acc.save_state()) == "checkpoint_9"  # after every numbered folder
    assert not any(n.startswith(".") for n in os.listdir(root))  # the crashed save's leftover is cleaned up


def test_manifest_names_outside_the_folder_are_refused_before_anything_is_read(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path / "project")
    train_step(model, opt, sched)
    good = acc.save_state()
    secret = tmp_path / "secret.safetensors"  # a file beside the checkpoint that it must never reach
    shutil.copy(os.path.join(good, "model.safetensors"), secret)
    train_step(model, opt, sched)
    before = snapshot(model, opt)
    root = tmp_path / "project" / "checkpoints"
    crafted = {"dotdot": "../../../secret.safetensors", "absolute": str(secret), "link": "model.safetensors"}
    for number, (how, name) in enumerate(crafted.items(), start=5):
        path = root / f"checkpoint_{number}"
        shutil.copytree(good, path)
        manifest = json.loads((path / "manifest.json").read_text())
        info = manifest["files"].pop("model.safetensors")
        if how == "link":  # a name inside the folder whose file is a link to one outside
            os.remove(path / "model.safetensors")
            os.symlink(secret, path / "model.safetensors")
        manifest["files"][name] = info
        manifest["contents"]["models"][0]["file"] = name
        (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(layout.IncompleteCheckpointError, match="names files outside the checkpoint folder") as e:
            acc.load_state(path)
        assert repr(name) in str(e.value) and str(path) in str(e.value)
        assert same(snapshot(model, opt), before)
    assert layout.newest_complete(str(root))[1] == good  # resume="auto" passes over crafted folders


def test_saving_into_the_same_folder_replaces_it_atomically(fresh_state, tmp_path):
    acc, model, opt, sched = setup(auto=False)
    target = tmp_path / "ckpt"
    acc.save_state(target)
    first = json.loads((target / "manifest.json").read_text())
    train_step(model, opt, sched)
    acc.save_state(target)
    second = json.loads((target / "manifest.json").read_text())
    assert first["files"]["model.safetensors"]["checksum"] != second["files"]["model.safetensors"]["checksum"]
    layout.wait_for_deletions()  # the replaced checkpoint is deleted in the background
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary or old folder left
    # A crashed save of this folder is cleaned up; another job's save in progress beside it is not.
    crashed = tmp_path / ".ckpt.tmp-0123456789abcdef0123456789abcdef"
    neighbour = tmp_path / ".other_run.tmp-fedcba9876543210fedcba9876543210"
    crashed.mkdir(), neighbour.mkdir()
    (neighbour / "model.safetensors").write_bytes(b"being written")
    acc.save_state(target)
    layout.wait_for_deletions()
    assert sorted(os.listdir(tmp_path)) == [".other_run.tmp-fedcba9876543210fedcba9876543210", "ckpt"]
    other = tmp_path / "not_a_checkpoint"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="not a hasten checkpoint"):
        acc.save_state(other)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="output_dir"):
        acc.save_state()


def test_a_failing_save_commits_nothing(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)

    def broken_hook(models, weights, folder):
        raise OSError("disk full")

    handle = acc.register_save_state_pre_hook(broken_hook)
    with pytest.raises(RuntimeError, match="disk full"):
        acc.save_state()
    assert os.listdir(tmp_path / "checkpoints") == [] and acc.save_iteration == 0
    handle.remove()
    assert os.path.basename(acc.save_state()) == "checkpoint_0"


def test_background_save_keeps_the_state_of_the_call_and_commits_behind_the_loop(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path, total_limit=2)
    train_step(model, opt, sched)
    before = snapshot(model, opt)
    target = acc.save_state(blocking=False)
    for _ in range(3):  # training goes on while the files are written
        train_step(model, opt, sched)
    after = snapshot(model, opt)
    acc.wait_for_checkpoint()
    assert layout.is_complete(target) and os.path.basename(target) == "checkpoint_0"
    acc.load_state(target)
    assert same(snapshot(model, opt), before) and not same(before, after)
    # back to back: each save waits for the one before; retention applies after each commit
    for _ in range(3):
        train_step(model, opt, sched)
        last = acc.save_state(blocking=False)
    acc.end_training()  # waits for the last one
    assert [n for n, _ in layout.numbered(str(tmp_path / "checkpoints"))] == [2, 3]
    assert layout.newest_complete(str(tmp_path / "checkpoints"))[1] == last
    acc.load_state()  # the newest, complete
    assert acc.project_configuration.iteration == 4


def test_a_script_that_ends_right_after_a_background_save_still_commits_it(tmp_path):
    import subprocess
    import sys

    target = tmp_path / "ckpt"
    code = ("import torch, hasten; acc = hasten.Accelerator(cpu=True); "
            "m = acc.prepare(torch.nn.Linear(256, 256)); "
            f"print(acc.save_state({str(target)!r}, blocking=False), flush=True)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(target) and layout.is_complete(str(target))


def test_a_failing_background_save_commits_nothing_and_is_reported(fresh_state, tmp_path, monkeypatch):
    from hasten.checkpointing import saver

    acc, model, opt, sched = setup(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saver, "write_safetensors", disk_full)
    acc.save_state(blocking=False)
    with pytest.raises(RuntimeError, match="(?s)background save to .*checkpoint_0: save_state failed; nothing was committed.*No space left"):
        acc.wait_for_checkpoint()
    assert os.listdir(tmp_path / "checkpoints") == []  # no folder, complete or temporary
    acc.wait_for_checkpoint()  # reported once
    acc.save_state(blocking=False)
    with pytest.raises(RuntimeError, match="No space left"):
        acc.save_state()  # the next save reports the previous failure before starting
    monkeypatch.undo()
    assert layout.is_complete(acc.save_state())


# -- loading: mismatches, corruption, pickle -------------------------------------------------------------
def test_mismatches_raise_one_clear_error_and_change_nothing(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)
    acc.register_for_checkpointing(Counter(1))
    train_step(model, opt, sched)
    folder = acc.save_state()
    reset_state()
    acc, model, opt, sched = setup(tmp_path, hidden=9)  # other shapes, and no registered object
    train_step(model, opt, sched)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointMismatchError) as info:
        acc.load_state(folder)
    text = str(info.value)
    assert "nothing was changed" in text and "1 objects given to register_for_checkpointing but this run has 0" in text
    assert same(snapshot(model, opt), before)
    counter = Counter(7)
    acc.register_for_checkpointing(counter)
    with pytest.raises(CheckpointMismatchError, match=r"model 0 \(Tied\): shapes differ for .*body.weight \(checkpoint \[8, 4\], model \[9, 4\]\)"):
        acc.load_state(folder)
    assert same(snapshot(model, opt), before) and counter.value == 7 and sched.get_last_lr() == [0.05]


def test_corrupted_file_is_detected_before_anything_changes(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)
    train_step(model, opt, sched)
    folder = acc.save_state()
    train_step(model, opt, sched)
    before = snapshot(model, opt)
    path = os.path.join(folder, "optimizer.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x40  # same size, one bit flipped in a moment tensor
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CheckpointCorruptError, match="optimizer.safetensors' is corrupted"):
        acc.load_state(folder, verify="checksum")
    assert same(snapshot(model, opt), before)
    with open(path, "ab") as f:  # a file of the wrong size is refused by the default check too
        f.write(b"\0")
    with pytest.raises(layout.IncompleteCheckpointError, match="wrong size: optimizer.safetensors"):
        acc.load_state(folder)
    assert same(snapshot(model, opt), before)


class Boom:
    """Unpickling this runs code (a marker file): the classic malicious checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickle_in_a_checkpoint_is_never_executed(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)
    acc.register_for_checkpointing(Opaque())
    with pytest.warns(UserWarning, match="needs pickle"):
        folder = acc.save_state()
    assert sorted(n for n in os.listdir(folder) if n.startswith("custom")) == ["custom_checkpoint_0.pt"]
    # an attacker swaps in a malicious pickle and fixes up the manifest so that the file verifies
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"thing": Boom(str(marker))}, protocol=2)
    path = os.path.join(folder, "custom_checkpoint_0.pt")
    with open(path, "wb") as f:
        f.write(payload)
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    manifest["files"]["custom_checkpoint_0.pt"].update(size=len(payload), checksum=checksum_buffer(
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)))
    manifest[layout.CHECKSUM_KEY] = layout.manifest_checksum(manifest)  # the manifest's own checksum too
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    before = snapshot(model, opt)
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        acc.load_state(folder)
    assert not marker.exists() and same(snapshot(model, opt), before)


def test_pickled_object_loads_with_the_explicit_opt_in(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)
    obj = Opaque()
    acc.register_for_checkpointing(obj)
    with pytest.warns(UserWarning, match="needs pickle"):
        folder = acc.save_state()
    obj.thing = None
    with pytest.raises(pickle.UnpicklingError):
        acc.load_state(folder)
    assert obj.thing is None
    acc.load_state(folder, load_kwargs={"weights_only": False})
    assert obj.thing.value == 5


def test_tied_weights_survive(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)
    train_step(model, opt, sched)
    folder = acc.save_state()
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert "head.weight" not in f.keys() and json.loads(f.metadata()["hasten_aliases"]) == {
            "head.weight": "embed.weight"}
    with torch.no_grad():
        model.embed.weight.zero_()
    acc.load_state(folder)
    assert model.head.weight is model.embed.weight and model.embed.weight.abs().sum() > 0


# -- hooks and resume="auto" -----------------------------------------------------------------------------
def test_pre_hooks_see_models_and_can_add_files(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path)
    calls = []

    def save_hook(models, weights, folder):
        calls.append(("save", len(models), len(weights), os.path.basename(folder).startswith(".checkpoint_0.tmp-")))
        with open(os.path.join(folder, "extra.json"), "w") as f:
            f.write('{"config": 1}')

    def load_hook(models, folder):
        calls.append(("load", len(models), os.path.basename(folder)))
        assert json.load(open(os.path.join(folder, "extra.json"))) == {"config": 1}

    acc.register_save_state_pre_hook(save_hook)
    handle = acc.register_load_state_pre_hook(load_hook)
    folder = acc.save_state()
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    assert manifest["files"]["extra.json"]["rank"] == "hook"  # committed and verified with the checkpoint
    acc.load_state(folder)
    handle.remove()
    acc.load_state(folder)
    assert calls == [("save", 1, 1, True), ("load", 1, "checkpoint_0")]


def test_resume_auto_starts_fresh_then_continues(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path, resume="auto")
    counter = Counter(0)
    acc.register_for_checkpointing(counter)
    assert counter.value == 0 and acc.resume == "auto"  # nothing to resume: a fresh start
    train_step(model, opt, sched)
    counter.value = 11
    acc.save_state()
    expected = snapshot(model, opt)
    reset_state()
    acc, model, opt, sched = setup(tmp_path, resume="auto")  # prepare() restored everything
    assert same(snapshot(model, opt), expected) and acc.save_iteration == 1
    counter = Counter(0)
    acc.register_for_checkpointing(counter)  # registered later: restored when registered
    assert counter.value == 11
    reset_state()
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        setup(tmp_path, auto=False, resume="auto")
    with pytest.raises(ValueError, match="resume='sometimes' is neither 'auto' nor an existing checkpoint folder"):
        setup(tmp_path, resume="sometimes")


def test_resume_auto_keeps_the_instance_plain(fresh_state, tmp_path):
    acc, model, opt, sched = setup(tmp_path, resume="auto")
    acc.save_state()
    reset_state()
    acc, model, opt, sched = setup(tmp_path, resume="auto")  # resumed by prepare() itself
    acc.register_for_checkpointing(Counter(0))
    assert acc.save_iteration == 1 and acc.resume == "auto"
    for name in ("prepare", "register_for_checkpointing", "_hasten_auto_resume"):
        assert name not in vars(acc), name  # no per-instance method or hidden entry
    assert acc.prepare.__func__ is type(acc).prepare
    acc.resume = None
    assert acc.resume is None and acc.save_state().endswith("checkpoint_1")


# -- seeking ---------------------------------------------------------------------------------------------
def test_seeking_gives_the_same_batches_as_walking_and_reads_no_skipped_data(fresh_state):
    from torch.utils.data import BatchSampler, SequentialSampler

    import hasten.data.samplers as samplers
    from hasten.data_loader import (
        BatchSamplerShard,
        SeedableRandomSampler,
        prepare_data_loader,
    )

    for n_data, size, procs, split, even, drop in [(13, 2, 2, False, True, False), (17, 3, 3, False, False, False),
                                                   (16, 4, 2, True, True, False), (15, 2, 2, False, True, True)]:
        for kind in ("seq", "rand"):
            for skip in range(0, 6):
                def make():
                    smp = SequentialSampler(range(n_data)) if kind == "seq" else SeedableRandomSampler(
                        range(n_data), data_seed=3)
                    return [BatchSamplerShard(BatchSampler(smp, size, drop), procs, r, split, even) for r in range(procs)]
                fast = make()
                for s in fast:
                    s._skip_next = skip
                original, samplers.seek_batches = samplers.seek_batches, lambda *a: None
                try:
                    slow = make()
                    for s in slow:
                        s._skip_next = skip
                    walked = [list(s) for s in slow]
                finally:
                    samplers.seek_batches = original
                assert [list(s) for s in fast] == walked

    class Counting(torch.utils.data.Dataset):
        reads = 0

        def __len__(self):
            return 1000

        def __getitem__(self, i):
            Counting.reads += 1
            return i

    dl = prepare_data_loader(torch.utils.data.DataLoader(Counting(), batch_size=10, shuffle=True), data_seed=1,
                             use_seedable_sampler=True)
    full = [b.tolist() for b in dl]
    dl.set_epoch(0)
    dl.load_state_dict({"epoch": 0, "batches_yielded": 90})
    Counting.reads = 0
    assert [b.tolist() for b in dl] == full[90:] and Counting.reads == 100


def test_preemption_saves_at_the_end_of_an_accumulation_window(fresh_state, tmp_path):
    """A signal in the middle of a window saves once the window's step is done: sharded strategies refuse
    mid-window saves (their partial gradients live in the engine), and a checkpoint then holds no partial
    gradients on any strategy."""
    import signal

    from hasten import Accelerator

    acc = Accelerator(gradient_accumulation_steps=4)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 2)), batch_size=1)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.save_on_preemption(output_dir=str(tmp_path / "ck"))
    seen = 0
    with pytest.raises(SystemExit):
        for (x,) in loader:
            with acc.accumulate(model):
                acc.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
            seen += 1
            if seen == 5:
                os.kill(os.getpid(), signal.SIGTERM)
    assert seen == 8  # saved when the loop asked for the 9th batch: the second window's step was done
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert not manifest["mid_accumulation"], manifest
