"""Host memory of ``save_state(blocking=False)``'s staging buffers: a layout change re-makes only the
part of the buffers that changed, ``ProjectConfiguration(staging_memory_limit=...)`` caps the memory
kept between saves, and ``free_memory()`` releases it; every checkpoint reloads to the state of its call."""

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from hasten.checkpointing import staging

CUSTOM_FILE = "custom_checkpoint_0.safetensors"


class Growing:
    """A registered object whose tensor may grow between saves (a buffer of collected values)."""

    def __init__(self, n: int, device) -> None:
        self.values = torch.arange(n, dtype=torch.float32, device=device)

    def grow(self, extra: int) -> None:
        more = torch.arange(extra, dtype=torch.float32, device=self.values.device) + float(self.values.numel())
        self.values = torch.cat([self.values, more])

    def state_dict(self) -> dict:
        return {"values": self.values}

    def load_state_dict(self, state: dict) -> None:
        self.values = state["values"].clone().to(self.values.device)


def _prepare(config=None):
    from hasten import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(project_config=config)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 8))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    growing = Growing(10, acc.device)
    acc.register_for_checkpointing(growing)
    return acc, model, opt, growing


def _step(acc, model, opt):
    x = torch.randn(4, 128, device=acc.device)
    acc.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt, growing):
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, entries in opt.state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": v.detach().clone() for k, v in entries.items() if torch.is_tensor(v)})
    out["growing"] = growing.values.clone()
    return out


def _assert_bitwise(found, expected):
    assert found.keys() == expected.keys()
    for key in expected:
        assert found[key].dtype == expected[key].dtype and torch.equal(found[key], expected[key]), key


def _assert_each_checkpoint_reloads(acc, model, opt, growing, saved):
    for folder, expected in saved:
        acc.load_state(folder)
        _assert_bitwise(_snapshot(model, opt, growing), expected)


@pytest.fixture
def allocations(monkeypatch):
    """Every staging arena made: (the files it holds, its bytes); ``.arenas``: weak references to them."""

    class Made(list):
        arenas: list = []

    made = Made()

    class Counted(staging.Arena):
        def __init__(self, layout, *args, **kwargs):
            super().__init__(layout, *args, **kwargs)
            made.append(({key[0] if isinstance(key, tuple) else key for key, *_ in layout}, self.nbytes))
            made.arenas.append(weakref.ref(self))

    monkeypatch.setattr(staging, "Arena", Counted)
    return made


def test_a_growing_registered_object_remakes_only_its_own_staging(fresh_state, tmp_path, allocations):
    acc, model, opt, growing = _prepare()
    _step(acc, model, opt)
    saved = []

    def save(name):
        start = len(allocations)
        acc.save_state(str(tmp_path / name), blocking=False)
        saved.append((str(tmp_path / name), _snapshot(model, opt, growing)))
        _step(acc, model, opt)  # training goes on while the save is written
        return allocations[start:]

    first = save("c0")
    everything = sum(nbytes for _, nbytes in first)
    assert everything > 400_000  # the model and its AdamW moments
    for i in range(1, 4):
        growing.grow(1)  # 4 bytes more at every save
        made = save(f"c{i}")
        others = [files for files, _ in made if files != {CUSTOM_FILE}]
        assert not others, f"save {i}: 4 bytes of growth in a registered object re-made {others}"
        assert sum(nbytes for _, nbytes in made) <= 16 * 4096
    growing.grow(100_000)  # a jump past what its part holds: that part alone is re-made
    made = save("jump")
    assert [files for files, _ in made] == [{CUSTOM_FILE}]
    assert made[0][1] < 2 * 100_010 * 4
    acc.wait_for_checkpoint()
    _assert_each_checkpoint_reloads(acc, model, opt, growing, saved)


def test_the_staging_memory_limit_caps_what_is_kept_and_every_checkpoint_stays_exact(fresh_state, tmp_path,
                                                                                      allocations):
    from hasten.utils import ProjectConfiguration

    limit = 300 * 1024  # room for the model's part, not for its AdamW moments as well
    acc, model, opt, growing = _prepare(ProjectConfiguration(staging_memory_limit=limit))
    saved = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            _step(acc, model, opt)
            growing.grow(1000)
            acc.save_state(str(tmp_path / f"c{i}"), blocking=False)
            saved.append((str(tmp_path / f"c{i}"), _snapshot(model, opt, growing)))
            stager = acc._checkpoints.background.stager
            assert 0 < stager.kept_bytes <= limit
        _step(acc, model, opt)
        acc.wait_for_checkpoint()
    # what did not fit was made for its save alone: freed once written; only the kept arenas live on
    alive = [ref() for ref in allocations.arenas if ref() is not None]
    kept = list(stager._arenas.values())
    assert len(allocations.arenas) > len(kept) and len(alive) == len(kept) and all(a in kept for a in alive)
    told = [str(w.message) for w in caught if "staging_memory_limit" in str(w.message)]
    assert len(told) == 1, told  # said once, not at every save
    assert "pageable" in told[0] and str(limit) in told[0]
    _assert_each_checkpoint_reloads(acc, model, opt, growing, saved)


def test_a_limit_lowered_to_zero_between_saves_releases_the_kept_buffers(fresh_state, tmp_path):
    acc, model, opt, growing = _prepare()
    _step(acc, model, opt)
    acc.save_state(str(tmp_path / "kept"), blocking=False)
    arenas = [weakref.ref(a) for a in acc._checkpoints.background.stager._arenas.values()]
    _step(acc, model, opt)
    acc.project_configuration.staging_memory_limit = "lots"
    with pytest.raises(ValueError, match="staging_memory_limit"):  # refused before the save starts
        acc.save_state(str(tmp_path / "bad"), blocking=False)
    acc.project_configuration.staging_memory_limit = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc.save_state(str(tmp_path / "c"), blocking=False)
    expected = _snapshot(model, opt, growing)
    _step(acc, model, opt)
    assert acc._checkpoints.background.stager.kept_bytes == 0
    acc.wait_for_checkpoint()
    assert arenas and all(ref() is None for ref in arenas)
    assert not (tmp_path / "bad").exists()
    _assert_each_checkpoint_reloads(acc, model, opt, growing, [(str(tmp_path / "c"), expected)])


def test_the_limit_is_read_from_sizes_and_the_environment_and_bad_values_name_the_setting(monkeypatch):
    from hasten.utils import ProjectConfiguration

    assert ProjectConfiguration().staging_memory_limit is None  # no limit unless asked
    assert ProjectConfiguration(staging_memory_limit="2GiB").staging_memory_limit == 2 * 2**30
    monkeypatch.setenv("HASTEN_STAGING_MEMORY_LIMIT", "512MiB")
    assert ProjectConfiguration().staging_memory_limit == 512 * 2**20
    assert ProjectConfiguration(staging_memory_limit=10).staging_memory_limit == 10  # the argument wins
    for bad in (-1, "lots", True):
        with pytest.raises(ValueError, match="staging_memory_limit"):
            ProjectConfiguration(staging_memory_limit=bad)
    monkeypatch.setenv("HASTEN_STAGING_MEMORY_LIMIT", "lots")
    with pytest.raises(ValueError, match="HASTEN_STAGING_MEMORY_LIMIT"):
        ProjectConfiguration()


def test_free_memory_releases_the_staging_buffers_and_the_next_save_still_works(fresh_state, tmp_path):
    acc, model, opt, growing = _prepare()
    _step(acc, model, opt)
    acc.save_state(str(tmp_path / "before"), blocking=False)
    stager = acc._checkpoints.background.stager
    arenas = [weakref.ref(a) for a in stager._arenas.values()]
    views = [weakref.ref(t) for t in stager.buffers.values()]
    assert arenas and views
    del stager
    acc.free_memory()
    gc.collect()
    assert all(ref() is None for ref in arenas), "free_memory() kept a staging arena alive"
    assert all(ref() is None for ref in views), "free_memory() kept a staging buffer alive"
    # free_memory() also drops the prepared objects (as Accelerate's does): prepare again, save, reload
    model, opt = acc.prepare(model, opt.optimizer)
    _step(acc, model, opt)
    acc.save_state(str(tmp_path / "after"), blocking=False)
    expected = _snapshot(model, opt, growing)
    _step(acc, model, opt)
    acc.wait_for_checkpoint()
    _assert_each_checkpoint_reloads(acc, model, opt, growing, [(str(tmp_path / "after"), expected)])


def test_a_sharded_save_stages_each_top_level_entry_apart(allocations):
    """``stage_tree`` (the sharded saves' path): a new optimizer state re-makes the optimizer's part only."""
    stager = staging.Stager()
    weight = torch.randn(64, 64)
    expected = weight.clone()
    tree = {"model_0": {"w": weight}, "optimizer_0": {"state": {}, "param_groups": [{"lr": 0.1}]}}
    stager.stage_tree(tree)
    start = len(allocations)
    tree["optimizer_0"]["state"] = {"w": {"exp_avg": torch.ones(64, 64), "step": torch.tensor(1.0)}}
    staged = stager.stage_tree(tree)
    assert [files for files, _ in allocations[start:]] == [{"/optimizer_0/state/w/exp_avg", "/optimizer_0/state/w/step"}]
    weight.add_(1)  # the copy does not follow the live tensor
    assert torch.equal(staged["model_0"]["w"], expected) and staged["optimizer_0"]["param_groups"] == [{"lr": 0.1}]
    assert torch.equal(staged["optimizer_0"]["state"]["w"]["exp_avg"], torch.ones(64, 64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_parts_are_pinned_apart_and_release_unpins_them():
    from hasten.checkpointing import saver

    stager = staging.Stager()
    big, small = torch.randn(1024, 1024, device="cuda"), torch.randn(10, device="cuda")
    first = stager.stage([saver.Item("model.safetensors", {"w": big}), saver.Item("custom.safetensors", {"v": small})])
    kept = first[0].tensors["w"]
    assert kept.is_pinned() and first[1].tensors["v"].is_pinned()
    grown = torch.randn(5000, device="cuda")  # the small part outgrows its page: re-made alone
    again = stager.stage([saver.Item("model.safetensors", {"w": big}), saver.Item("custom.safetensors", {"v": grown})])
    assert again[0].tensors["w"].data_ptr() == kept.data_ptr() and again[1].tensors["v"].is_pinned()
    assert torch.equal(again[1].tensors["v"], grown.cpu()) and torch.equal(again[0].tensors["w"], big.cpu())
    stager.release()
    assert not kept.is_pinned()  # unregistered now, freed with the last view
