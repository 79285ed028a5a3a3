"""The file layer (``hasten/files/``): what is verified is what is loaded, every reader refuses links,
non-files and names leaving their folder, and the rules have one implementation each."""

import json
import os
import re
import shutil
import threading
import time

import pytest
import torch
from torch import nn

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "hasten")


def _filled(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _all_equal(model: nn.Module, value: float) -> bool:
    return all(bool((p == value).all()) for p in model.parameters())


@pytest.fixture
def saved(tmp_path, fresh_state):
    """An Accelerator whose model is saved twice: ``good`` holds 1.0 everywhere, ``evil/model.safetensors``
    the same names and sizes holding 666.0; the live model then holds 0.0."""
    from hasten import Accelerator

    acc = Accelerator()
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    _filled(model, 666.0)
    evil = acc.save_state(str(tmp_path / "evil"))
    _filled(model, 1.0)
    good = acc.save_state(str(tmp_path / "good"))
    _filled(model, 0.0)
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(os.path.join(evil, "model.safetensors"), outside)
    assert os.path.getsize(outside) == os.path.getsize(os.path.join(good, "model.safetensors"))
    return acc, model, good, str(outside)


def _tamper(path: str, evil: str, how: str) -> None:
    if how == "replaced":  # another file renamed over it
        copy = path + ".new"
        shutil.copyfile(evil, copy)
        os.replace(copy, path)
    elif how == "linked":  # a link to a file outside the folder renamed over it
        link = path + ".link"
        os.symlink(evil, link)
        os.replace(link, path)
    else:  # rewritten in place, same inode
        with open(evil, "rb") as f:
            data = f.read()
        with open(path, "r+b") as f:
            f.write(data)


@pytest.mark.parametrize("how", ["replaced", "linked", "rewritten"])
@pytest.mark.parametrize("verify", ["checksum", "size"])
def test_load_state_loads_the_bytes_it_verified(saved, how, verify):
    """load_state's pre-hooks run after the files were verified and before they are read: a file swapped
    there must not be what the model gets."""
    acc, model, good, evil = saved
    acc.register_load_state_pre_hook(lambda models, folder: _tamper(os.path.join(folder, "model.safetensors"),
                                                                    evil, how))
    try:
        acc.load_state(good, verify=verify)
    except Exception as e:  # noqa: BLE001 - an error is acceptable if it names the file
        assert "model.safetensors" in str(e), e
        assert _all_equal(model, 0.0)  # nothing applied
        return
    assert _all_equal(model, 1.0), "the model holds bytes that were not verified"
    assert not any(bool((p == 666.0).any()) for p in model.parameters())


@pytest.mark.parametrize("verify", ["checksum", "size"])
def test_loaded_state_does_not_follow_the_file(tmp_path, fresh_state, verify):
    """After load_state, rewriting the checkpoint's files in place changes nothing live (no state stays
    backed by a mapping of the file)."""
    from hasten import Accelerator

    acc = Accelerator()
    model = nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    model(torch.ones(2, 256, device=acc.device)).sum().backward()
    opt.step()
    folder = acc.save_state(str(tmp_path / "ck"))
    acc.load_state(folder, verify=verify)
    state = [v for entry in opt.state_dict()["state"].values() for v in entry.values() if v.numel() > 1]
    snapshot = [v.clone() for v in state] + [p.detach().clone() for p in model.parameters()]
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.seek(size // 2)
                f.write(b"\x7f" * (size - size // 2))
    live = state + [p.detach() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, live)), "live state changed with the file"


@pytest.mark.parametrize("how", ["replaced", "rewritten"])
def test_load_checkpoint_in_model_loads_the_bytes_it_verified(tmp_path, monkeypatch, how):
    """``save_model`` files carry their own checksum; what ``load_checkpoint_in_model`` verified is what it
    loads, even when the file changes between the check and the copy into the model."""
    import hasten.model_loading as model_loading
    from hasten import load_checkpoint_in_model
    from hasten.saving import save_model

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    _filled(model, 666.0)
    save_model(model.state_dict(), str(tmp_path / "evil"))
    _filled(model, 1.0)
    save_model(model.state_dict(), str(tmp_path / "good"))
    _filled(model, 0.0)
    target = str(tmp_path / "good" / "model.safetensors")
    evil = str(tmp_path / "evil" / "model.safetensors")
    checked = model_loading.fit_problems  # called after every file was checked, before any tensor is copied

    def tamper_then_check(*args, **kwargs):
        _tamper(target, evil, how)
        return checked(*args, **kwargs)

    monkeypatch.setattr(model_loading, "fit_problems", tamper_then_check)
    try:
        load_checkpoint_in_model(model, str(tmp_path / "good"))
    except Exception as e:  # noqa: BLE001
        assert "model.safetensors" in str(e), e
        return
    assert _all_equal(model, 1.0), "the model holds bytes that were not verified"


def test_a_file_rewritten_while_it_is_read_fails_its_checksum(tmp_path, monkeypatch):
    from hasten.files import reading
    from hasten.files.checksum import checksum_buffer
    from hasten.files.errors import CheckpointCorruptError

    data = os.urandom(3 * reading.PIECE + 100)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    recorded = checksum_buffer(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert reading.read_inside(str(tmp_path), "f.bin", len(data), recorded).bytes() == data
    real, calls = reading.pread_into, []

    def rewriting(fd, view, position, name):
        calls.append(position)
        if len(calls) == 2:  # between two pieces: another process writes the rest of the file
            with open(path, "r+b") as f:
                f.seek(2 * reading.PIECE)
                f.write(b"\0" * 100)
        return real(fd, view, position, name)

    monkeypatch.setattr(reading, "pread_into", rewriting)
    with pytest.raises(CheckpointCorruptError, match=re.escape(str(path))):
        reading.read_inside(str(tmp_path), "f.bin", len(data), recorded)


# -- every reader refuses a link, a non-file and a name leaving the folder --------------------------------
def _link_to_copy(path, tmp_path):
    outside = tmp_path / ("outside-" + os.path.basename(path))
    shutil.copyfile(path, outside)
    os.remove(path)
    os.symlink(outside, path)


def _fifo(path, tmp_path):
    os.remove(path)
    os.mkfifo(path)


def _state_folder(tmp_path):
    from hasten import Accelerator

    acc = Accelerator()
    model, opt = acc.prepare(nn.Linear(4, 4), torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1))
    return acc, acc.save_state(str(tmp_path / "ck"))


def _load_state(tmp_path, name, spoil):
    acc, folder = _state_folder(tmp_path)
    spoil(os.path.join(folder, name), tmp_path)
    acc.load_state(folder)


def _save_model_folder(tmp_path):
    from hasten.saving import save_model

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    save_model(model.state_dict(), str(tmp_path / "weights"), max_shard_size="5KB")
    return model, str(tmp_path / "weights")


def _load_model(tmp_path, name, spoil):
    from hasten import load_checkpoint_in_model

    model, folder = _save_model_folder(tmp_path)
    if name == "shard":
        name = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[0]
    spoil(os.path.join(folder, name), tmp_path)
    load_checkpoint_in_model(model, folder)


def _offload_folder(tmp_path):
    from hasten.utils.offload import offload_state_dict

    folder = str(tmp_path / "offload")
    offload_state_dict(folder, {"w": torch.arange(6.0), "v": torch.ones(3)})
    return folder


def _load_offloaded(tmp_path, name, spoil):
    from hasten.utils.offload import load_offloaded_tensor, read_index

    folder = _offload_folder(tmp_path)
    spoil(os.path.join(folder, name), tmp_path)
    index = read_index(folder)
    load_offloaded_tensor(folder, "w", index["w"])


def _dcp(tmp_path, name, spoil):
    import torch.distributed.checkpoint as dcp

    from hasten.checkpointing.dcp_reader import validate
    from hasten.files.unpickling import dcp_metadata

    folder = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=folder, no_dist=True)
    if name == "shard":
        name = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    spoil(os.path.join(folder, name), tmp_path)
    validate(folder, dcp_metadata(os.path.join(folder, ".metadata")))


READERS = {
    "load_state file": (_load_state, "model.safetensors"),
    "load_state manifest": (_load_state, "manifest.json"),
    "save_model index": (_load_model, "model.safetensors.index.json"),
    "save_model shard": (_load_model, "shard"),
    "offload index": (_load_offloaded, "index.json"),
    "offload .dat": (_load_offloaded, "w.dat"),
    "DCP metadata": (_dcp, ".metadata"),
    "DCP shard": (_dcp, "shard"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("spoil", [_link_to_copy, _fifo], ids=["link", "fifo"])
@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_links_and_non_files_naming_them(tmp_path, fresh_state, reader, spoil):
    read, name = READERS[reader]
    done: list = []

    def run():
        try:
            read(tmp_path, name, spoil)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - judged below
            done.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert done, f"{reader}: reading a {spoil.__name__[1:]} hung (a FIFO opened for reading waits for a writer)"
    error = done[0]
    assert error is not None, f"{reader}: a {spoil.__name__[1:]} in place of a file was read"
    assert isinstance(error, (ValueError, RuntimeError, OSError)), repr(error)
    named = "shard" if name == "shard" else name
    assert named in str(error) or (named == "shard" and re.search(r"\.(safetensors|distcp)", str(error))), error


def test_names_leaving_the_folder_are_refused(tmp_path, fresh_state):
    from hasten import load_checkpoint_in_model
    from hasten.utils.offload import load_offloaded_tensor, read_index

    model, folder = _save_model_folder(tmp_path)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    first = next(iter(index["weight_map"]))
    shutil.copyfile(os.path.join(folder, index["weight_map"][first]), tmp_path / "stolen.safetensors")
    index["weight_map"][first] = "../stolen.safetensors"
    index["metadata"].pop("hasten_checksum", None)
    index["metadata"].pop("hasten_checksums", None)
    json.dump(index, open(index_path, "w"))
    with pytest.raises(Exception, match=re.escape("../stolen.safetensors")):
        load_checkpoint_in_model(model, folder)
    offload = _offload_folder(tmp_path)
    entries = read_index(offload)
    entry = dict(entries["w"], safetensors_file="../stolen.safetensors", weight_name="0.weight")
    with pytest.raises(Exception, match=re.escape("../stolen.safetensors")):
        load_offloaded_tensor(offload, "w", entry)


def test_open_inside_follows_no_link_on_the_way(tmp_path):
    from hasten.files.errors import UnsafeFileError
    from hasten.files.paths import open_inside

    (tmp_path / "ck" / "sub").mkdir(parents=True)
    (tmp_path / "ck" / "sub" / "f").write_bytes(b"inside")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_bytes(b"outside")
    os.close(open_inside(str(tmp_path / "ck"), "sub/f"))
    shutil.rmtree(tmp_path / "ck" / "sub")
    os.symlink(tmp_path / "elsewhere", tmp_path / "ck" / "sub")  # a folder on the way swapped for a link
    with pytest.raises(UnsafeFileError, match="sub"):
        open_inside(str(tmp_path / "ck"), "sub/f")
    for name in ("../elsewhere/f", "/etc/passwd", "sub/../f", ""):
        with pytest.raises(UnsafeFileError):
            open_inside(str(tmp_path / "ck"), name)
    with pytest.raises(UnsafeFileError, match="folder"):
        open_inside(str(tmp_path), "elsewhere")
    with pytest.raises(FileNotFoundError, match="missing-file"):
        open_inside(str(tmp_path), "missing-file")


# -- one implementation of each rule -------------------------------------------------------------------
# Places outside hasten/files/ allowed to rename: whole checkpoint folders (exchange, recovery, trash) and
# files moved between folders of one checkpoint; and the launcher's interprocess files, written by
# stdlib-only code that runs before hasten is importable (no durability wanted there).
ALLOWED = {
    ("checkpointing/layout.py", "os.rename("): "moving whole checkpoint folders into place, recovering, trashing",
    ("checkpointing/solo.py", "os.replace("): "moving a process's finished files into the committed checkpoint",
    ("checkpointing/commit.py", "os.replace("): "copy_links: a save hook's link replaced by a copy of its file",
    ("checkpointing/commit.py", "S_ISLNK"): "copy_links: finding the links a save hook left in the folder",
    ("commands/_bootstrap.py", "os.replace("): "the failure record the launcher reads (stdlib only)",
    ("commands/_heartbeat.py", "os.replace("): "the heartbeat file, rewritten every second (stdlib only)",
    ("commands/hangs.py", "os.replace("): "the dump request the watchdog hands the processes",
}
RULES = ("os.replace(", "os.rename(", "O_NOFOLLOW", "islink(", "S_ISLNK", "ACCESS_COPY", "mkstemp(", "fsync(",
         "safe_open(", "safetensors.torch import load_file", "json.loads(bytes(raw")


def test_each_file_rule_has_one_implementation():
    found = []
    for folder, _, names in os.walk(SRC):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, SRC).replace(os.sep, "/")
            if rel.startswith("files/"):
                continue
            text = open(path, encoding="utf-8").read()
            for rule in RULES:
                if rule in text and (rel, rule) not in ALLOWED:
                    found.append(f"{rel}: {rule}")
    assert not found, ("file rules written outside hasten/files/ (use files.paths / files.durable / "
                       "files.reading / files.safetensors_format instead): " + ", ".join(found))
    unused = [k for k in ALLOWED if k[1] not in open(os.path.join(SRC, k[0]), encoding="utf-8").read()]
    assert not unused, f"allowed exceptions no longer needed: {unused}"


def test_importing_the_layer_is_cheap():
    import subprocess
    import sys

    code = ("import sys; import hasten.files.paths, hasten.files.durable, hasten.files.errors; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(SRC)))
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_reading_works_in_a_forked_child(tmp_path):
    """The layer's threads do not survive a fork: a child that reads after its parent did must not wait
    forever on them (the kill -9 tests fork their savers from a process that loaded before)."""
    from hasten.files import reading

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * reading.PIECE))
    reading.file_checksum(str(path))  # the parent's threads exist now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the read completes
        code = 1
        try:
            reading.read_inside(str(tmp_path), "f.bin", None, True)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("a read in a forked child hung on the parent's threads")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_a_load_gives_its_file_memory_back_when_it_returns(tmp_path):
    """The private copy of a weights file is freed when the load returns, not when the garbage collector
    next runs (a file and its tensor view referring to each other kept it: 300 MB per load, freed at random
    points inside later work)."""
    import gc
    import weakref

    from hasten.files.weights import read_weights
    from hasten.model_loading import load_checkpoint_in_model
    from hasten.saving import save_model

    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB of weights
    save_model(model.state_dict(), str(tmp_path / "m"))
    load_checkpoint_in_model(model, str(tmp_path / "m"))  # the first load's lasting allocations happen here
    gc.collect()
    gc.disable()
    try:
        file = read_weights(str(tmp_path / "m" / "model.safetensors"))
        view, gone = file.view, weakref.ref(file)
        del file, view
        assert gone() is None
        before = _resident_bytes()
        for _ in range(3):
            load_checkpoint_in_model(model, str(tmp_path / "m"))
        assert _resident_bytes() - before < 32 << 20
    finally:
        gc.enable()
