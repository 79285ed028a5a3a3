"""Staging of ``save_state(blocking=False)``: one host buffer per file, reused from save to save,
page-locked only for CUDA tensors on a machine with CUDA, never overwritten while a writer reads it;
and every checkpoint holds the state of the moment it was asked for."""

import time

import pytest
import torch
from torch import nn

from hasten.checkpointing import commit, saver
from hasten.checkpointing.staging import Stager, wants_pinned


def _prepare(n_models=1):
    from hasten import Accelerator

    torch.manual_seed(0)
    acc = Accelerator()
    pairs = []
    for i in range(n_models):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4 + i))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        pairs.append(acc.prepare(model, opt))
    return acc, pairs


def _step(acc, model, opt):
    x = torch.randn(8, 16, device=acc.device)
    acc.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _snapshot(pairs):
    out = {}
    for i, (model, opt) in enumerate(pairs):
        out.update({f"{i}.model.{k}": v.detach().clone() for k, v in model.state_dict().items()})
        for pid, entries in opt.state_dict()["state"].items():
            out.update({f"{i}.opt.{pid}.{k}": v.detach().clone() for k, v in entries.items() if torch.is_tensor(v)})
    return out


def _bitwise_equal(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _storages(buffers):
    return {t.untyped_storage().data_ptr() for t in buffers.values()}


def _files(buffers):
    return {name for name, _ in buffers}


def _of_file(buffers, name):
    return {key: t for key, t in buffers.items() if key[0] == name}


def test_pinned_memory_only_for_cuda_tensors_where_cuda_works():
    assert wants_pinned(["cuda", "cpu"], cuda_available=True)
    assert not wants_pinned(["cuda"], cuda_available=False)  # pinning without CUDA raises
    assert not wants_pinned(["cpu"], cuda_available=True)  # host tensors gain nothing from it
    assert not wants_pinned([], cuda_available=True)
    assert not wants_pinned(["cpu"])
    assert wants_pinned(["cuda"]) == torch.cuda.is_available()


def test_staging_host_tensors_never_asks_cuda_for_pinned_memory(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("staging of host tensors called into CUDA")

    monkeypatch.setattr(torch.cuda, "cudart", refuse)
    stager = Stager()
    w = torch.arange(12.0).view(3, 4)
    staged = stager.stage([saver.Item("m.safetensors", {"w": w})])
    w.add_(1)  # the live tensor changes in place; the snapshot does not
    assert torch.equal(staged[0].tensors["w"], torch.arange(12.0).view(3, 4))
    assert not any(b.is_pinned() for b in stager.buffers.values())


def test_two_background_saves_reuse_one_buffer_and_keep_the_state_of_their_call(fresh_state, tmp_path):
    acc, pairs = _prepare()
    (model, opt), = pairs
    _step(acc, model, opt)
    snapshots, buffers = [], []
    for i in range(2):
        acc.save_state(str(tmp_path / f"c{i}"), blocking=False)
        snapshots.append(_snapshot(pairs))
        buffers.append(acc._checkpoints.background.stager.buffers)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # changed while the save is written
        _step(acc, model, opt)
    acc.wait_for_checkpoint()
    # the tensors of each file in ONE host allocation, and the second save reused the first one's
    assert all(len(_storages(_of_file(buffers[0], name))) == 1 for name in _files(buffers[0]))
    assert _storages(buffers[0]) == _storages(buffers[1])
    assert not _bitwise_equal(snapshots[0], snapshots[1])
    for i, expected in enumerate(snapshots):
        acc.load_state(str(tmp_path / f"c{i}"))
        assert _bitwise_equal(_snapshot(pairs), expected)


def test_a_layout_change_reallocates_and_both_checkpoints_stay_exact(fresh_state, tmp_path):
    acc, pairs = _prepare(n_models=2)
    _step(acc, *pairs[0])  # the second optimizer has no state yet
    acc.save_state(str(tmp_path / "before"), blocking=False)
    first = _snapshot(pairs)
    buffers = acc._checkpoints.background.stager.buffers
    _step(acc, *pairs[0])
    _step(acc, *pairs[1])  # its moments appear: the staged layout changes
    acc.save_state(str(tmp_path / "after"), blocking=False)
    second = _snapshot(pairs)
    grown = acc._checkpoints.background.stager.buffers
    _step(acc, *pairs[0])
    _step(acc, *pairs[1])
    acc.wait_for_checkpoint()
    assert len(grown) > len(buffers) and all(len(_storages(_of_file(grown, name))) == 1 for name in _files(grown))
    unchanged = _files(grown) - {"optimizer_1.safetensors"}  # only the part that changed was re-made
    assert all(_storages(_of_file(grown, name)) == _storages(_of_file(buffers, name)) for name in unchanged)
    assert not any(k.startswith("1.opt.") for k in first) and any(k.startswith("1.opt.") for k in second)
    acc.load_state(str(tmp_path / "after"))
    assert _bitwise_equal(_snapshot(pairs), second)
    acc2, pairs2 = _prepare(n_models=2)  # a fresh run: the second optimizer stays without state
    acc2.load_state(str(tmp_path / "before"))
    assert _bitwise_equal(_snapshot(pairs2), first)


def test_restaging_waits_for_the_writer_still_reading_the_buffers():
    background = commit.Background()
    live = torch.full((1024,), 1.0)
    staged = background.stager.stage([saver.Item("m.safetensors", {"w": live})])
    seen = []

    def slow_writer():
        time.sleep(0.5)  # the next save is staged meanwhile
        seen.append(staged[0].tensors["w"].clone())

    background.start("target", slow_writer)
    live.fill_(2.0)
    again = background.stager.stage([saver.Item("m.safetensors", {"w": live})])
    background.wait()
    assert torch.equal(seen[0], torch.full((1024,), 1.0)), "the buffer was overwritten while it was being written"
    assert torch.equal(again[0].tensors["w"], live)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_staged_into_page_locked_memory():
    stager = Stager()
    w = torch.randn(256, 256, device="cuda")
    staged = stager.stage([saver.Item("m.safetensors", {"w": w, "host": torch.ones(3)})])
    assert staged[0].tensors["w"].is_pinned() and torch.equal(staged[0].tensors["w"], w.cpu())
    w.add_(1)
    torch.cuda.synchronize()
    assert not torch.equal(staged[0].tensors["w"], w.cpu())
    again = stager.stage([saver.Item("m.safetensors", {"w": w, "host": torch.ones(3)})])
    assert torch.equal(again[0].tensors["w"], w.cpu())
    assert again[0].tensors["w"].data_ptr() == staged[0].tensors["w"].data_ptr()



# -- loading: read from the files into the live tensors ------------------------------------------------
def test_views_of_the_read_bytes_give_each_tensor_back(tmp_path):
    from hasten.files.reading import read_path
    from hasten.files.safetensors_format import SafetensorsView, write_safetensors

    tensors = {"f32": torch.randn(33, 7), "bf16": torch.randn(5, 3).to(torch.bfloat16), "mask": torch.rand(9) > 0.5,
               "i64": torch.arange(11), "empty": torch.empty(0, 4)}
    path = str(tmp_path / "t.safetensors")
    write_safetensors(path, tensors)
    file = read_path(path)
    view = SafetensorsView(file)
    for name, expected in tensors.items():
        dest = torch.full_like(expected, 7) if expected.numel() else torch.empty_like(expected)
        dest.copy_(view.tensor(name))
        assert torch.equal(dest, expected), name
    strided = torch.zeros(7, 33).t()  # into a live tensor that is not contiguous
    strided.copy_(view.tensor("f32"))
    assert torch.equal(strided, tensors["f32"])
    file.close()


def test_load_keeps_the_live_tensors_and_matches_the_saved_state(fresh_state, tmp_path):
    acc, pairs = _prepare()
    (model, opt), = pairs
    _step(acc, model, opt)
    acc.save_state(str(tmp_path / "c"))
    expected = _snapshot(pairs)
    pointers = [p.data_ptr() for p in model.parameters()]
    moments = [v.data_ptr() for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    _step(acc, model, opt)
    acc.load_state(str(tmp_path / "c"))
    assert _bitwise_equal(_snapshot(pairs), expected)
    assert [p.data_ptr() for p in model.parameters()] == pointers  # read in place, as load_state_dict copies
    assert [v.data_ptr() for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)] == moments
    acc2, pairs2 = _prepare()  # a fresh run: the optimizer has no state to read into yet
    acc2.load_state(str(tmp_path / "c"))
    assert _bitwise_equal(_snapshot(pairs2), expected)
    model2, opt2 = pairs2[0]
    for param in model2.parameters():  # moments where their parameter lives, the step counter on the host
        state = getattr(opt2, "optimizer", opt2).state[param]
        assert state["exp_avg"].device == param.device and state["exp_avg_sq"].device == param.device
        assert state["step"].device.type == "cpu"  # cpu-on-purpose: the step counter stays on the host
    _step(acc2, *pairs2[0])  # the loaded state is ordinary, writable memory
    assert not _bitwise_equal(_snapshot(pairs2), expected)


def test_modules_that_customise_loading_still_load_through_load_state_dict(fresh_state, tmp_path):
    from hasten import Accelerator

    class Halves(nn.Linear):
        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"] / 2
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    calls = []
    acc = Accelerator()
    model = acc.prepare(nn.Sequential(nn.Linear(4, 4), Halves(4, 4)))
    model[0].register_load_state_dict_pre_hook(lambda *args, **kwargs: calls.append("pre"))
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    acc.save_state(str(tmp_path / "c"))
    acc.load_state(str(tmp_path / "c"))
    assert calls == ["pre"]
    assert torch.equal(model[1].weight, saved["1.weight"] / 2) and torch.equal(model[0].weight, saved["0.weight"])
