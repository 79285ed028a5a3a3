"""Gaps between hasten and Accelerate that Accelerate's own tests and client scripts run into (issue 26).

Where it is cheap, the same call is made on the installed ``accelerate`` and the two answers are
compared; hasten is the library under test, accelerate only the reference.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.second = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.norm(self.first(x)))


# -- 1. names that stop a script at import ------------------------------------------------------------

@pytest.mark.parametrize("module, name", [
    ("hasten.utils.modeling", "load_checkpoint_in_model"),
    ("hasten.utils.modeling", "get_state_dict_offloaded_model"),
    ("hasten.utils.modeling", "align_module_device"),
    ("hasten.utils.modeling", "get_state_dict_from_offload"),
    ("hasten.utils", "align_module_device"),
    ("hasten.utils", "load_checkpoint_in_model"),
    ("hasten.big_modeling", "attach_layerwise_casting_hooks"),
    ("hasten.big_modeling", "load_checkpoint_in_model"),
    ("hasten.data_loader", "DataLoaderStateMixin"),
    ("hasten.commands.launch", "launch_command_parser"),
    ("hasten.commands.launch", "launch_command"),
])
def test_accelerate_import_paths_exist(module: str, name: str) -> None:
    reference = importlib.import_module(module.replace("hasten", "accelerate"))
    assert hasattr(reference, name)  # the path is Accelerate's
    assert callable(getattr(importlib.import_module(module), name))


def test_modeling_import_stays_light() -> None:
    # hasten.utils.modeling must not pull the checkpoint loader (and its imports) until asked for it.
    code = ("import sys, hasten.utils.modeling as m; assert 'hasten.model_loading' not in sys.modules; "
            "m.load_checkpoint_in_model; assert 'hasten.model_loading' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_state_dict_of_an_offloaded_model_matches_the_plain_one() -> None:
    from hasten import cpu_offload
    from hasten.utils.modeling import get_state_dict_from_offload, get_state_dict_offloaded_model

    torch.manual_seed(0)
    model = TwoLayers()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_offload(model, execution_device=torch.device("cpu"))  # cpu-on-purpose: the weights go to meta
    assert model.first.weight.device.type == "meta"
    got = get_state_dict_offloaded_model(model)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert model.first.weight.device.type == "meta"  # offloaded again afterwards
    partial = get_state_dict_from_offload(model.first, "first.weight", {"first.weight": "placeholder"})
    assert torch.equal(partial["first.weight"], expected["first.weight"])


def test_layerwise_casting_matches_accelerate() -> None:
    from accelerate.big_modeling import attach_layerwise_casting_hooks as reference_attach

    from hasten.big_modeling import attach_layerwise_casting_hooks

    torch.manual_seed(0)
    ours, theirs = TwoLayers().eval(), TwoLayers().eval()
    theirs.load_state_dict(ours.state_dict())
    attach_layerwise_casting_hooks(ours, storage_dtype=torch.bfloat16, compute_dtype=torch.float32,
                                   skip_modules_pattern=("second",))
    reference_attach(theirs, storage_dtype=torch.bfloat16, compute_dtype=torch.float32,
                     skip_modules_pattern=("second",))
    dtypes = {n: p.dtype for n, p in ours.named_parameters()}
    assert dtypes == {n: p.dtype for n, p in theirs.named_parameters()}
    assert dtypes["first.weight"] == torch.bfloat16 and dtypes["second.weight"] == torch.float32
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    assert ours.first.weight.dtype == torch.bfloat16  # back to storage after the forward


def test_data_loader_state_mixin_tracks_remainder() -> None:
    from hasten.data_loader import DataLoaderStateMixin
    from hasten.state import GradientState

    class Loader(DataLoaderStateMixin):
        def __init__(self) -> None:
            self.dataset, self.total_batch_size, self._drop_last = list(range(10)), 4, False
            self.gradient_state = GradientState()

    loader = Loader()
    assert loader.end_of_dataloader is False and loader.remainder == -1
    loader.begin()
    assert loader.remainder == 2
    assert loader.gradient_state.active_dataloader is loader
    loader.end()
    assert loader.gradient_state.active_dataloader is not loader


def test_build_device_mesh_without_layout_is_none_and_a_wrong_size_is_named() -> None:
    from hasten.utils import ParallelismConfig

    assert ParallelismConfig().build_device_mesh("cpu") is None  # cpu-on-purpose: nothing to lay out
    with pytest.raises(ValueError, match="tp_size=2"):
        ParallelismConfig(tp_size=2).build_device_mesh("cpu")  # cpu-on-purpose: this process runs alone


def test_programmatic_launch(tmp_path) -> None:
    from hasten.commands.launch import launch_command, launch_command_parser

    marker = tmp_path / "ran.txt"
    script = tmp_path / "job.py"
    script.write_text(f"import os\nopen({str(marker)!r}, 'a').write(os.environ['RANK'] + '\\n')\n")
    before = dict(os.environ)
    args = launch_command_parser().parse_args(["--cpu", "--num_processes", "2", str(script)])
    launch_command(args)
    assert sorted(marker.read_text().split()) == ["0", "1"]
    assert dict(os.environ) == before  # the caller's environment is left as it was
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(3)\n")
    with pytest.raises(subprocess.CalledProcessError):
        launch_command(launch_command_parser().parse_args(["--cpu", "--num_processes", "1", str(bad)]))


def test_lomo_backward_needs_a_rate_and_a_lomo_optimizer() -> None:
    from hasten import Accelerator

    acc = Accelerator()
    model = nn.Linear(2, 1).to(acc.device)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.randn(3, 2, device=acc.device)).sum()
    with pytest.raises(ValueError, match="learning_rate"):
        acc.lomo_backward(loss, None)
    with pytest.raises((ImportError, ValueError), match="lomo"):
        acc.lomo_backward(loss, 0.1)


def test_lomo_backward_runs_the_fused_step(monkeypatch) -> None:
    import types

    calls = []

    class Lomo(torch.optim.SGD):  # the package's shape: fused_backward does backward and update
        def fused_backward(self, loss: torch.Tensor, lr: float) -> None:
            calls.append(lr)
            loss.backward()
            for group in self.param_groups:
                group["lr"] = lr
            self.step()
            self.zero_grad()

    fake = types.ModuleType("lomo_optim")
    fake.Lomo, fake.AdaLomo = Lomo, type("AdaLomo", (Lomo,), {})
    monkeypatch.setitem(sys.modules, "lomo_optim", fake)
    from hasten import Accelerator

    acc = Accelerator()
    model = nn.Linear(2, 1).to(acc.device)
    model, opt = acc.prepare(model, Lomo(model.parameters(), lr=1.0))
    before = model.weight.detach().clone()
    acc.lomo_backward(model(torch.ones(1, 2, device=acc.device)).sum(), 0.5)
    assert calls == [0.5]
    assert torch.allclose(model.weight.detach(), before - 0.5)


def test_ulysses_adapter_returns_the_loader_without_sequence_parallelism() -> None:
    from hasten import Accelerator
    from hasten.utils import ParallelismConfig

    acc = Accelerator()
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(4)), batch_size=2))
    assert acc.deepspeed_ulysses_dl_adapter(loader, nn.Linear(1, 1)) is loader
    config = ParallelismConfig(sp_size=2)  # hasten's own Ulysses: a mesh axis, counted as Accelerate counts it
    assert (config.sp_backend, config.total_size, config.non_dp_dim_names) == ("hasten", 2, ["sp"])
    with pytest.raises(ValueError, match="cp_size=2 with sp_size=2: context and sequence parallelism"):
        ParallelismConfig(cp_size=2, sp_size=2)  # Accelerate's rule: they exclude each other


# -- 2. a bf16-prepared model under torch.compile(fullgraph=True) ------------------------------------

def test_bf16_prepared_model_compiled_by_the_user_with_fullgraph() -> None:
    from hasten import Accelerator

    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(nn.Linear(8, 8).to(acc.device))
    x = torch.randn(4, 8, device=acc.device)
    assert torch.equal(torch.compile(model, fullgraph=True, backend="eager")(x), model(x))


def test_bf16_fullgraph_through_the_dynamo_plugin_matches_eager() -> None:
    import copy

    from hasten import Accelerator
    from hasten.utils import TorchDynamoPlugin

    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="bf16", dynamo_plugin=TorchDynamoPlugin(backend="eager", fullgraph=True))
    plain = nn.Linear(8, 8).to(acc.device)
    reference = copy.deepcopy(plain)
    compiled = acc.prepare(plain)
    x = torch.randn(4, 8, device=acc.device)
    with torch.autocast(acc.device.type, dtype=torch.bfloat16):
        expected = reference(x).float()
    out = compiled(x)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert not torch.is_autocast_enabled(acc.device.type)


# -- 3. debug_launcher after a failed launch ------------------------------------------------------------

def _fails_on_rank_one() -> None:
    from hasten import Accelerator

    acc = Accelerator()
    if acc.process_index == 1:
        raise ValueError("rank 1 fails on purpose")
    acc.wait_for_everyone()


def _fails_at_once() -> None:
    raise ValueError("fails before any process group")


def _agrees() -> None:
    from hasten import Accelerator

    acc = Accelerator()
    assert acc.num_processes == 2
    acc.wait_for_everyone()


def test_debug_launcher_runs_after_failed_launches() -> None:
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, {tests!r})
        import pytest
        from test_accelerate_gaps import _agrees, _fails_at_once, _fails_on_rank_one
        from hasten import debug_launcher
        from hasten.launchers import LaunchError
        import gc
        from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
        kept = []
        for failing in (_fails_on_rank_one, _fails_at_once):
            with pytest.raises(LaunchError) as info:
                debug_launcher(failing)
            kept.append(info)  # as a test runner keeps what it caught, traceback and frames included
        # no rendezvous (and its listening TCP store) outlives the failed launches, for children to inherit
        assert not [o for o in gc.get_objects() if isinstance(o, StaticTCPRendezvous)]
        debug_launcher(_agrees)
        print("second launch done")
    """).format(tests=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "second launch done" in done.stdout, done.stderr[-3000:]


# -- 4. sharding data smaller than one global batch; loaders built by hand ---------------------------------

@pytest.mark.parametrize("length, batch_size, split", [(3, 2, False), (7, 3, False), (2, 2, True), (3, 4, True)])
def test_uneven_batch_sampler_shard_matches_accelerate(length: int, batch_size: int, split: bool) -> None:
    from accelerate.data_loader import BatchSamplerShard as Reference
    from torch.utils.data import BatchSampler

    from hasten.data_loader import BatchSamplerShard

    batches = BatchSampler(range(length), batch_size, drop_last=False)
    for rank in range(2):
        ours = BatchSamplerShard(batches, 2, rank, split_batches=split, even_batches=False)
        theirs = Reference(batches, 2, rank, split_batches=split, even_batches=False)
        assert list(ours) == list(theirs), (rank, list(ours), list(theirs))
        assert len(ours) == len(theirs)


def test_uneven_data_smaller_than_one_step_leaves_no_process_empty() -> None:
    # BatchSamplerShard built by hand gives rank 1 no batch at all here, as Accelerate's does. A
    # prepared loader (pad_lone_step=True) differs on purpose: with an empty rank, a loop that runs a
    # collective per batch (DDP's backward, gather_for_metrics) waits for ever on rank 0; hasten
    # pads the epoch's only step (the padding is dropped again by gather_for_metrics).
    from accelerate.data_loader import BatchSamplerShard as Reference
    from torch.utils.data import BatchSampler

    from hasten.data_loader import BatchSamplerShard

    batches = BatchSampler(range(2), 3, drop_last=False)
    assert list(Reference(batches, 2, 1, even_batches=False)) == []
    assert list(BatchSamplerShard(batches, 2, 1, even_batches=False)) == []
    assert list(BatchSamplerShard(batches, 2, 0, even_batches=False, pad_lone_step=True)) == [[0, 1]]
    assert list(BatchSamplerShard(batches, 2, 1, even_batches=False, pad_lone_step=True)) == [[0, 1, 0]]


def test_loaders_built_by_hand_match_accelerate() -> None:
    from accelerate.data_loader import DataLoaderDispatcher as RefDispatcher
    from accelerate.data_loader import DataLoaderShard as RefShard
    from accelerate.data_loader import skip_first_batches as ref_skip

    from hasten.data_loader import DataLoaderDispatcher, DataLoaderShard, skip_first_batches

    def batches(loader) -> list:
        return [b.tolist() for b in loader]

    for ours, theirs in ((DataLoaderDispatcher, RefDispatcher), (DataLoaderShard, RefShard)):
        for kwargs in ({"batch_size": 4}, {"batch_size": 3, "drop_last": True}):
            mine, ref = ours(range(10), **kwargs), theirs(range(10), **kwargs)
            assert batches(mine) == batches(ref), (ours.__name__, kwargs)
            assert batches(skip_first_batches(mine, 1)) == batches(ref_skip(ref, 1)), (ours.__name__, kwargs)
            ends = []
            for _ in mine:
                ends.append(mine.end_of_dataloader)
            assert ends == [False] * (len(ends) - 1) + [True]


# -- 5. saving tied weights; saving a disk-offloaded model ---------------------------------------------

def test_safe_save_of_tied_weights_keeps_one_name_like_accelerate(tmp_path, caplog) -> None:
    from accelerate.utils import save as reference_save
    from safetensors.torch import load_file

    from hasten.utils import save

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight = model[0].weight
    reference_save(model.state_dict(), tmp_path / "theirs.safetensors", safe_serialization=True)
    caplog.clear()
    with caplog.at_level("WARNING"):  # a log record naming what was left out, as Accelerate's
        save(model.state_dict(), tmp_path / "ours.safetensors", safe_serialization=True)
    assert [r.name for r in caplog.records] == ["hasten.utils.other"] and "1.weight" in caplog.records[0].message
    ours, theirs = load_file(tmp_path / "ours.safetensors"), load_file(tmp_path / "theirs.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_save_model_reads_disk_offloaded_weights(tmp_path) -> None:
    from safetensors.torch import load_file

    from hasten import Accelerator, disk_offload

    torch.manual_seed(0)
    model = TwoLayers()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    disk_offload(model, tmp_path / "offload", execution_device=torch.device("cpu"))  # cpu-on-purpose
    assert model.first.weight.device.type == "meta"
    Accelerator().save_model(model, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) == set(expected)
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    assert model.first.weight.device.type == "meta"  # still offloaded


# -- 6. smaller differences ---------------------------------------------------------------------------------

def test_dynamo_plugin_to_kwargs_reports_values_from_the_environment(monkeypatch) -> None:
    from accelerate.utils import TorchDynamoPlugin as Reference

    from hasten.utils import TorchDynamoPlugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "reduce-overhead")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    assert TorchDynamoPlugin().to_kwargs() == Reference().to_kwargs() == {
        "backend": "eager", "mode": "reduce-overhead", "fullgraph": True}
    assert os.environ["ACCELERATE_DYNAMO_BACKEND"] == "eager"  # the environment is given back


def test_device_map_key_naming_no_module_warns_like_accelerate() -> None:
    import accelerate as reference

    import hasten

    for library in (reference, hasten):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        with pytest.warns(UserWarning, match="nope"):
            library.dispatch_model(model, {"0": "cpu", "1": "cpu", "nope": "cpu"})  # cpu-on-purpose
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keys naming tensors of a module are fine
        hasten.dispatch_model(nn.Sequential(nn.Linear(2, 2)), {"0.weight": "cpu", "0.bias": "cpu"})  # cpu-on-purpose


def test_registering_objects_without_state_raises_value_error_naming_each() -> None:
    from hasten import Accelerator

    acc = Accelerator()
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError) as info:  # Accelerate's type (hasten raised TypeError)
        acc.register_for_checkpointing(torch.ones(1), torch.ones(2), net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert "Item at index 0" in str(info.value) and "Item at index 1" in str(info.value)
    assert "index 2" not in str(info.value) and "index 3" not in str(info.value)
