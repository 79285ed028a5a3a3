"""The pieces of big-model inference: hooks, tensor placement, sizes and budgets, cpu/disk offload,
and a user-shaped loop that creates and frees dispatched models."""

from __future__ import annotations

import gc
import inspect
import json
import os
import shutil
import weakref

import pytest
import torch
from torch import nn

from hasten import (
    PartialState,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from hasten.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from hasten.model_loading import load_checkpoint_in_model
from hasten.saving import save_model
from hasten.utils import (
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_memory,
    set_module_tensor_to_device,
)

DEVICE = PartialState().default_device


class Recorder(ModelHook):
    """Adds ``delta`` to the first input and multiplies the output by ``factor``; logs its calls."""

    def __init__(self, log: list, tag: str, delta: float = 0.0, factor: float = 1.0) -> None:
        self.log, self.tag, self.delta, self.factor = log, tag, delta, factor

    def init_hook(self, module):
        self.log.append(f"init {self.tag}")
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.log.append(f"pre {self.tag}")
        return (args[0] + self.delta, *args[1:]), kwargs

    def post_forward(self, module, output):
        self.log.append(f"post {self.tag}")
        return output * self.factor

    def detach_hook(self, module):
        self.log.append(f"detach {self.tag}")
        return module


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, shift=None):
        hidden = self.body(self.embed(ids)) * self.scale
        if shift is not None:
            hidden = hidden + shift
        return self.head(self.norm(hidden))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(DEVICE).eval()


# -- hooks ------------------------------------------------------------------------------------------
def test_hook_changes_inputs_and_outputs_and_removal_restores_the_module():
    layer = nn.Linear(4, 4).to(DEVICE)
    x = torch.randn(2, 4, device=DEVICE)
    plain = layer(x)
    log: list = []
    hook = Recorder(log, "a", delta=1.0, factor=2.0)
    assert add_hook_to_module(layer, hook) is layer and layer._hf_hook is hook
    expected = nn.functional.linear(x + 1.0, layer.weight, layer.bias) * 2.0
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer.forward(x), expected)  # calling forward directly runs the hook too
    assert log == ["init a", "pre a", "post a", "pre a", "post a"]
    assert inspect.signature(layer.forward) == inspect.signature(nn.Linear(1, 1).forward)  # (input)
    remove_hook_from_module(layer)
    assert log[-1] == "detach a"
    assert not hasattr(layer, "_hf_hook") and not hasattr(layer, "_old_forward") and "forward" not in vars(layer)
    assert torch.equal(layer(x), plain)


def test_append_chains_hooks_in_order_and_replacing_drops_the_old_one():
    layer = nn.Identity()
    log: list = []
    add_hook_to_module(layer, Recorder(log, "a", delta=1.0))
    add_hook_to_module(layer, Recorder(log, "b", factor=3.0), append=True)
    assert isinstance(layer._hf_hook, SequentialHook) and [h.tag for h in layer._hf_hook.hooks] == ["a", "b"]
    assert torch.equal(layer(torch.zeros(2)), torch.full((2,), 3.0))
    assert log == ["init a", "detach a", "init a", "init b", "pre a", "pre b", "post a", "post b"]
    add_hook_to_module(layer, Recorder(log, "c", delta=5.0))  # no append: replaces both
    assert torch.equal(layer(torch.zeros(2)), torch.full((2,), 5.0))
    remove_hook_from_module(layer)
    assert torch.equal(layer(torch.zeros(2)), torch.zeros(2))


def test_a_forward_set_on_the_instance_comes_back_and_no_grad_is_honoured():
    layer = nn.Linear(3, 3)
    custom = lambda x: x * 7  # noqa: E731 - someone else's per-instance forward
    layer.forward = custom

    class NoGrad(ModelHook):
        no_grad = True

    add_hook_to_module(layer, NoGrad())
    out = layer(torch.ones(1, 3, requires_grad=True))
    assert torch.equal(out, torch.full((1, 3), 7.0)) and not out.requires_grad
    remove_hook_from_module(layer)
    assert layer.forward is custom


def test_hooked_modules_are_freed_without_the_garbage_collector():
    gc.disable()
    try:
        model = make_net()
        cpu_offload(model, execution_device=DEVICE)
        alive = weakref.ref(model)
        del model
        assert alive() is None  # no reference cycle through the wrapped forward
    finally:
        gc.enable()


def test_a_copied_hooked_module_runs_its_own_forward():
    import copy

    log: list = []
    layer = nn.Linear(2, 2)
    add_hook_to_module(layer, Recorder(log, "a", factor=0.0))
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.fill_(1.0)
        twin.bias.zero_()
    remove_hook_from_module(layer)  # the copy keeps its hook, and uses its own weights
    assert torch.equal(twin(torch.ones(1, 2)), torch.zeros(1, 2))
    remove_hook_from_module(twin)
    assert torch.equal(twin(torch.ones(1, 2)), torch.full((1, 2), 2.0))


def test_align_devices_hook_moves_inputs_and_returns_outputs_on_the_input_device():
    layer = nn.Linear(4, 2)
    add_hook_to_module(layer, AlignDevicesHook(execution_device=DEVICE, io_same_device=True))
    assert layer.weight.device.type == DEVICE.type
    x = torch.randn(3, 4)
    out = layer(x)
    assert out.device == x.device
    remove_hook_from_module(layer)
    torch.testing.assert_close(out, layer(x.to(DEVICE)).cpu(), rtol=0, atol=0)


# -- tensor placement and ties ------------------------------------------------------------------------
def test_set_module_tensor_to_device_from_meta_with_a_value():
    with init_empty_weights():
        layer = nn.Linear(3, 2)
    layer.weight.requires_grad_(False)
    value = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    set_module_tensor_to_device(layer, "weight", DEVICE, value=value)
    assert isinstance(layer.weight, nn.Parameter) and not layer.weight.requires_grad
    assert layer.weight.dtype == torch.float32 and layer.weight.device.type == DEVICE.type  # the module's dtype
    assert torch.equal(layer.weight.cpu(), value.float())
    with pytest.raises(ValueError, match="'bias' is on the meta device .* pass value="):
        set_module_tensor_to_device(layer, "bias", DEVICE)
    with pytest.raises(ValueError) as wrong_shape:  # str() is Accelerate's sentence; hasten's fix is a note
        set_module_tensor_to_device(layer, "bias", DEVICE, value=torch.zeros(3))
    assert str(wrong_shape.value) == ('Trying to set a tensor of shape torch.Size([3]) in "bias" (which has shape '
                                      'torch.Size([2])), this looks incorrect.')
    assert wrong_shape.value.__notes__ == ["'bias' of Linear is [2], the value [3]: the value (checkpoint) does not "
                                           "belong to this model"]
    set_module_tensor_to_device(layer, "bias", DEVICE, value=torch.ones(2), dtype=torch.float16)
    assert layer.bias.dtype == torch.float16
    net = nn.Sequential(nn.BatchNorm1d(2))
    set_module_tensor_to_device(net, "0.num_batches_tracked", "cpu", value=torch.tensor(5), dtype=torch.float16)
    assert net[0].num_batches_tracked.dtype == torch.long and net[0].num_batches_tracked.item() == 5
    with pytest.raises(ValueError, match="no parameter or buffer 'nope'"):
        set_module_tensor_to_device(net, "0.nope", "cpu")


def test_tied_params_map_shares_one_copy_per_device():
    net = make_net()
    source = net.embed.weight
    shared: dict = {source.data_ptr(): {}}
    set_module_tensor_to_device(net, "embed.weight", "meta")
    set_module_tensor_to_device(net, "head.weight", "meta")
    for name in ("embed.weight", "head.weight"):
        set_module_tensor_to_device(net, name, DEVICE, value=source, tied_params_map=shared)
    assert net.embed.weight is net.head.weight
    assert find_tied_parameters(net) == [["embed.weight", "head.weight"]]


# -- sizes and budgets --------------------------------------------------------------------------------
def test_compute_module_sizes_by_hand():
    net = Net()
    sizes = compute_module_sizes(net)
    embed, linear, norm, scale = 16 * 8 * 4, (8 * 8 + 8) * 4, 2 * 8 * 4, 8 * 4
    assert sizes["embed"] == sizes["embed.weight"] == embed
    assert sizes["head"] == 0  # the tied weight counts once, under its first name
    assert sizes["body"] == 2 * linear and sizes["body.0.bias"] == 32
    assert sizes[""] == embed + 2 * linear + norm + scale
    half = compute_module_sizes(net, dtype=torch.float16)
    assert half[""] == sizes[""] // 2
    counted = compute_module_sizes(nn.BatchNorm1d(4), dtype="float16")
    assert counted[""] == 4 * 2 * 2 + 4 * 2 * 2 + 8  # num_batches_tracked (int64) is never cast
    special = compute_module_sizes(net, special_dtypes={"embed.weight": torch.int8})
    assert special[""] == sizes[""] - embed + 16 * 8


def test_get_max_memory_and_balanced_memory_by_hand():
    assert get_max_memory({"cpu": "2KiB", 1: "1GB", 0: 500, "disk": "1MB"}) == {
        0: 500, 1: 10**9, "cpu": 2048, "disk": 10**6}
    with pytest.raises(ValueError, match="max_memory has keys \\['gpu0'\\]"):
        get_max_memory({"gpu0": 10})
    with pytest.raises(ValueError, match="'lots' is not a number of bytes"):
        get_max_memory({"cpu": "lots"})
    assert "cpu" in get_max_memory()
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])  # 440 bytes each, 1760 in all
    # each GPU but the last: 1760 // 2 + int(1.25 * mean layer 440) = 880 + 550
    assert get_balanced_memory(model, {0: 10**4, 1: 10**4, "cpu": 10**5}) == {0: 1430, 1: 10**4, "cpu": 10**5}
    # a no-split block bigger than the mean sets the margin
    blocks = nn.Sequential(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), nn.Linear(10, 10), nn.Linear(10, 10))
    got = get_balanced_memory(blocks, {0: 10**4, 1: 10**4, 2: 10**4}, no_split_module_classes=["Sequential"])
    assert got == {0: 1760 // 3 + int(1.25 * 880), 1: 1760 // 3 + int(1.25 * 880), 2: 10**4}
    # low_zero: GPU 0 keeps what the others cannot take
    assert get_balanced_memory(model, {0: 10**4, 1: 1000, 2: 10**4}, low_zero=True)[0] == 0
    assert get_balanced_memory(model, {"cpu": 123}) == {"cpu": 123}  # no accelerator: unchanged


# -- cpu and disk offload -----------------------------------------------------------------------------
def inputs():
    return torch.randint(0, 16, (3, 5), device=DEVICE), torch.randn(3, 5, 8, device=DEVICE)


def test_cpu_offload_keeps_weights_off_the_module_and_gives_equal_outputs():
    ids, shift = inputs()
    model = make_net()
    with torch.no_grad():
        want = model(ids, shift=shift)
    cpu_offload(model, execution_device=DEVICE)
    assert model.body[0].weight.device.type == "meta" and model.head.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(model(ids, shift=shift), want)
    assert model.body[0].weight.device.type == "meta"  # dropped again after the forward
    assert find_tied_parameters(model) == [["embed.weight", "head.weight"]]  # the tie is one object still
    remove_hook_from_submodules(model)  # weights come back
    assert all(p.device.type == DEVICE.type for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(ids, shift=shift), want)


def test_disk_offload_reads_weights_from_the_folder(tmp_path):
    ids, shift = inputs()
    model = make_net()
    with torch.no_grad():
        want = model(ids, shift=shift)
    disk_offload(model, tmp_path, execution_device=DEVICE)
    assert (tmp_path / "index.json").is_file() and model.norm.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(model(ids, shift=shift), want)
    assert find_tied_parameters(model) == [["embed.weight", "head.weight"]]
    fresh = make_net(seed=1)  # other weights: the existing folder is used as it is
    disk_offload(fresh, tmp_path, execution_device=DEVICE)
    with torch.no_grad():
        assert torch.equal(fresh(ids, shift=shift), want)


def test_cpu_offload_with_hook_moves_models_in_turn():
    ids, shift = inputs()
    first, second = make_net(0), make_net(1)
    with torch.no_grad():
        want_1, want_2 = first(ids, shift=shift), second(ids, shift=shift)
    first, hook_1 = cpu_offload_with_hook(first, execution_device=DEVICE)
    second, hook_2 = cpu_offload_with_hook(second, execution_device=DEVICE, prev_module_hook=hook_1)
    assert first.embed.weight.device.type == "cpu" and second.embed.weight.device.type == "cpu"  # cpu-on-purpose: offload target
    with torch.no_grad():
        assert torch.equal(first(ids, shift=shift), want_1)
        assert first.embed.weight.device.type == DEVICE.type  # moved for its forward, and stays
        assert torch.equal(second(ids, shift=shift), want_2)
    assert first.embed.weight.device.type == "cpu"  # cpu-on-purpose: offloaded just before the second model ran
    assert second.embed.weight.device.type == DEVICE.type
    hook_2.offload()
    assert second.embed.weight.device.type == "cpu"  # cpu-on-purpose: offload target
    hook_2.remove()
    assert not hasattr(second, "_hf_hook") and "forward" not in vars(second)


# -- the way users run it -----------------------------------------------------------------------------
def test_create_and_free_dispatched_models_in_a_loop(tmp_path):
    ids, shift = inputs()
    source = make_net()
    with torch.no_grad():
        want = source(ids, shift=shift)
    save_model(source.state_dict(), tmp_path / "ckpt", max_shard_size="200B")
    offload = tmp_path / "offload"
    runs_on = (DEVICE.index or 0) if DEVICE.type == "cuda" else "cpu"
    plan = {"embed": "cpu", "head": "cpu", "body.0": "disk", "body.1": runs_on, "body.2": "disk", "norm": "disk",
            "": "cpu"}
    files = None
    for _ in range(3):
        with init_empty_weights():
            model = Net()
        model = load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map=plan, offload_folder=offload)
        with torch.no_grad():
            assert torch.equal(model(ids, shift=shift), want)
        now = sorted(os.listdir(offload))
        assert files is None or len(now) == len(files)  # loading again into the folder does not pile up files
        files = now
        index = json.loads((offload / "index.json").read_text())
        assert {e["safetensors_file"] for e in index.values()} == set(now) - {"index.json"}
        alive = weakref.ref(model)
        del model
        assert alive() is None  # freed at once: nothing (hooks, weights maps) keeps it alive
    assert nn.Module.register_parameter is nn.Module.__dict__["register_parameter"]


def test_cpu_modules_load_per_forward_when_the_main_device_is_not_the_cpu(tmp_path):
    # With a GPU as the main device, modules mapped to "cpu" keep their weights in RAM and load them
    # onto the GPU for each forward. Without a GPU, main device "cpu:0" takes that same path.
    ids, shift = inputs()
    source = make_net()
    with torch.no_grad():
        want = source(ids, shift=shift)
    save_model(source.state_dict(), tmp_path / "ckpt", max_shard_size="200B")
    main = torch.device("cpu", 0) if DEVICE.type == "cpu" else DEVICE
    plan = {"embed": "cpu", "head": "cpu", "body.0": "disk", "norm": "disk", "": "cpu"}
    with init_empty_weights():
        model = Net()
    load_checkpoint_in_model(model, tmp_path / "ckpt", device_map=plan, offload_folder=tmp_path / "off")
    dispatch_model(model, plan, main_device=main, offload_dir=tmp_path / "off")
    assert model.embed.weight.device.type == "meta" and model.body[2].weight.device.type == "meta"
    assert model.scale.device.type == main.type  # buffers are not offloaded: they live on the main device
    assert model.head.weight is model.embed.weight
    with torch.no_grad():
        assert torch.equal(model(ids, shift=shift), want)
        assert torch.equal(model(ids.cpu(), shift=shift.cpu()), want.cpu())  # outputs on the input's device
    assert model.embed.weight.device.type == "meta" and model.head.weight is model.embed.weight


def test_planner_names_reachable_from_the_modeling_module_as_in_accelerate():
    # Accelerate keeps the planner in accelerate.utils.modeling; scripts import it from there.
    from hasten.utils import device_map
    from hasten.utils.modeling import convert_file_size_to_int, get_balanced_memory, get_max_memory

    assert get_max_memory is device_map.get_max_memory and get_balanced_memory is device_map.get_balanced_memory
    assert convert_file_size_to_int("1KB") == 1000


# -- the rest of accelerate.utils' big-model names, against Accelerate on the same inputs --------------
import accelerate.utils as acc  # noqa: E402

import hasten.utils as hu  # noqa: E402

LAST_NAMES = ("align_module_device", "calculate_maximum_sizes", "check_tied_parameters_in_config",
              "check_tied_parameters_on_same_device", "dtype_byte_size", "extract_submodules_state_dict",
              "has_offloaded_params", "id_tensor_storage", "load_offloaded_weight", "load_offloaded_weights",
              "load_state_dict", "offload_weight", "save_offload_index")


@pytest.mark.parametrize("name", LAST_NAMES)
def test_last_big_model_names_have_accelerates_signature(name):
    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(getattr(hu, name)) == shape(getattr(acc, name)), name


def test_dtype_sizes_and_storage_ids_match_accelerate():
    from hasten.utils.kinds import CustomDtype

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8,
                  torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2):
        assert hu.dtype_byte_size(dtype) == acc.dtype_byte_size(dtype), dtype
    for custom in CustomDtype:
        assert hu.dtype_byte_size(custom) == acc.dtype_byte_size(getattr(acc.CustomDtype, custom.name))
    base = torch.arange(12.0, device=DEVICE)
    for tensor in (base, base[3:], base.view(3, 4).t(), base.clone(), torch.empty(3, 4, device="meta"),
                   torch.empty(5, dtype=torch.bfloat16, device="meta")[1:]):
        assert hu.id_tensor_storage(tensor) == acc.id_tensor_storage(tensor)
    assert hu.id_tensor_storage(base[3:]) == hu.id_tensor_storage(base) != hu.id_tensor_storage(base.clone())


def test_calculate_maximum_sizes_matches_accelerate():
    model = make_net()
    assert hu.calculate_maximum_sizes(model) == acc.calculate_maximum_sizes(model)
    model._no_split_modules = ["Sequential"]  # the body counts as one layer now
    ours = hu.calculate_maximum_sizes(model)
    assert ours == acc.calculate_maximum_sizes(model) and ours[1][1] == ["body"]
    assert ours[0] == sum(t.numel() * 4 for t in model.state_dict().values()) - model.head.weight.numel() * 4


def test_tie_checks_match_accelerate(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    for tie in (True, False):
        config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, tie_word_embeddings=tie)
        with init_empty_weights():
            model = GPT2LMHeadModel(config)
        assert hu.check_tied_parameters_in_config(model) is acc.check_tied_parameters_in_config(model) is tie
    assert hu.check_tied_parameters_in_config(make_net()) is acc.check_tied_parameters_in_config(make_net()) is False

    ties = [["embed.weight", "head.weight"]]
    import warnings

    with warnings.catch_warnings(), caplog.at_level("WARNING"):
        warnings.simplefilter("error")  # a log record, as Accelerate's, not a Python warning
        caplog.clear()
        hu.check_tied_parameters_on_same_device(ties, {"embed": "cpu", "": "disk"})
        [record] = caplog.records
        assert record.name == "hasten.utils.modeling" and "Tied parameters are on different devices" in record.message
        hu.check_tied_parameters_on_same_device(ties, {"": "cpu", "body": "disk"})
        assert len(caplog.records) == 1
    for fn in (hu.check_tied_parameters_on_same_device, acc.check_tied_parameters_on_same_device):
        with pytest.raises(ValueError):
            fn(ties, {"embed": "cpu"})


def test_extract_submodules_state_dict_matches_accelerate():
    state = {f"h.{i}.{p}": torch.tensor(float(i)) for i in (1, 10, 2) for p in ("w", "b")} | {"h.1": torch.tensor(0.)}
    for names in (["h.1"], ["h.10", "h.1"], [""], ["h"], ["h.2.w", "h.1"]):
        ours, theirs = hu.extract_submodules_state_dict(state, names), acc.extract_submodules_state_dict(state, names)
        assert list(ours) == list(theirs) and all(ours[k] is theirs[k] for k in ours), names


def test_load_state_dict_matches_accelerate(tmp_path):
    from safetensors.torch import save_file

    state = {"embed.weight": torch.randn(4, 3), "body.0.weight": torch.randn(2, 2), "body.10.bias": torch.arange(3),
             "norm.weight": torch.ones(2, dtype=torch.bfloat16)}
    path = str(tmp_path / "model.safetensors")
    save_file(state, path, metadata={"format": "pt"})
    device = str(DEVICE)  # Accelerate's load_state_dict takes strings (safetensors refuses torch.device)
    maps = (None, {"": device}, {"embed": device, "body.0": "cpu", "body.1": "disk", "": "cpu"},
            {"body": "disk", "norm": device})
    for device_map in maps:
        ours, theirs = hu.load_state_dict(path, device_map), acc.load_state_dict(path, device_map)
        assert set(ours) == set(theirs) == set(state), device_map
        for key, value in ours.items():
            assert value.device == theirs[key].device and torch.equal(value.cpu(), state[key]), (device_map, key)
    assert hu.load_state_dict(path, {"embed": DEVICE, "": "cpu"})["embed.weight"].device.type == DEVICE.type

    save_file(state, str(tmp_path / "bare.safetensors"))  # no metadata: read as PyTorch, with a warning
    with pytest.warns(UserWarning, match="no safetensors metadata"):
        assert torch.equal(hu.load_state_dict(str(tmp_path / "bare.safetensors"))["body.10.bias"], state["body.10.bias"])
    save_file(state, str(tmp_path / "tf.safetensors"), metadata={"format": "tf"})
    with pytest.raises(ValueError, match="tf"):
        hu.load_state_dict(str(tmp_path / "tf.safetensors"))

    torch.save(state, tmp_path / "model.bin")
    ours, theirs = hu.load_state_dict(str(tmp_path / "model.bin")), acc.load_state_dict(str(tmp_path / "model.bin"))
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in state)
    torch.save({"w": torch.ones(1), "evil": Recorder([], "x")}, tmp_path / "pickled.bin")
    with pytest.raises(Exception, match="Weights only load failed"):  # never unpickles arbitrary objects
        hu.load_state_dict(str(tmp_path / "pickled.bin"))


OFFLOAD_CASES = {"a.weight": torch.randn(3, 4), "b.half": torch.randn(5).half(), "c.bf": torch.randn(2, 3).bfloat16(),
                 "d.f8": torch.randn(4).to(torch.float8_e4m3fn), "e.long": torch.arange(6).view(2, 3),
                 "f.mask": torch.tensor([True, False, True]), "g.scalar": torch.tensor(2.5)}


def test_offload_weight_writes_accelerates_format_both_ways(tmp_path):
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir(), theirs_dir.mkdir()
    ours_index, theirs_index = {}, {}
    for name, tensor in OFFLOAD_CASES.items():
        assert hu.offload_weight(tensor, name, str(ours_dir), index=ours_index) is ours_index
        acc.offload_weight(tensor, name, str(theirs_dir), index=theirs_index)
        # byte for byte the same file, and the same index entry
        assert (ours_dir / f"{name}.dat").read_bytes() == (theirs_dir / f"{name}.dat").read_bytes(), name
    assert ours_index == theirs_index  # the caller's dict holds Accelerate's entries, nothing more
    assert hu.offload_weight(torch.ones(2), "x", str(ours_dir)) is None and (ours_dir / "x.dat").exists()
    with pytest.raises(ValueError, match="outside the offload folder"):
        hu.offload_weight(torch.ones(2), "../escape", str(ours_dir))

    hu.save_offload_index({"x": {"dtype": "float32", "shape": [2]}}, str(ours_dir))
    hu.save_offload_index(ours_index, str(ours_dir))  # merged into what is there
    hu.save_offload_index(None, str(ours_dir))
    acc.save_offload_index(theirs_index, str(theirs_dir))
    on_disk = json.loads((ours_dir / "index.json").read_text())
    # in the file, each entry also holds the checksum of its .dat bytes, which hasten verifies on reading
    # (Accelerate ignores the key)
    assert {k: {f: v for f, v in e.items() if f != "checksum"} for k, e in on_disk.items()} == {
        **ours_index, "x": {"dtype": "float32", "shape": [2]}}
    assert all(e["checksum"].startswith("bsum64:") for e in on_disk.values())
    assert "checksum" not in ours_index["a.weight"]  # the caller's dict is left as it was
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ours_dir, corrupt)
    raw = bytearray((corrupt / "a.weight.dat").read_bytes())
    raw[5] ^= 0x40
    (corrupt / "a.weight.dat").write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="'a.weight' .* is corrupted"):
        hu.OffloadedWeightsLoader(save_folder=str(corrupt))["a.weight"]

    for name, tensor in OFFLOAD_CASES.items():  # each library reads the other's files
        for reader, folder in ((hu.load_offloaded_weight, theirs_dir), (acc.load_offloaded_weight, ours_dir)):
            got = reader(str(folder / f"{name}.dat"), on_disk[name])
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else got,
                               tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), name
    loader = acc.OffloadedWeightsLoader(save_folder=str(ours_dir))  # Accelerate's loader reads hasten's folder
    assert torch.equal(loader["c.bf"], OFFLOAD_CASES["c.bf"])


def test_offload_state_dict_writes_accelerates_layout_with_checksums(tmp_path):
    state = {k: v for k, v in make_net(1).cpu().state_dict().items()}
    acc.offload_state_dict(str(tmp_path / "acc"), state)
    hu.offload_state_dict(str(tmp_path / "ours"), state)
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "acc"))  # <name>.dat + index.json
    for name in state:
        assert (tmp_path / "ours" / f"{name}.dat").read_bytes() == (tmp_path / "acc" / f"{name}.dat").read_bytes()
    ours = json.loads((tmp_path / "ours" / "index.json").read_text())
    theirs = json.loads((tmp_path / "acc" / "index.json").read_text())
    assert {k: {f: v for f, v in e.items() if f != "checksum"} for k, e in ours.items()} == theirs
    assert all(e["checksum"].startswith("bsum64:") for e in ours.values())
    for loader in (acc.OffloadedWeightsLoader, hu.OffloadedWeightsLoader):  # each library reads it
        weights = loader(save_folder=str(tmp_path / "ours"))
        assert all(torch.equal(weights[k], v) for k, v in state.items())
    name = next(iter(state))
    raw = bytearray((tmp_path / "ours" / f"{name}.dat").read_bytes())
    raw[-1] ^= 0x01  # a flipped bit is caught by hasten's reader
    (tmp_path / "ours" / f"{name}.dat").write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="is corrupted"):
        hu.OffloadedWeightsLoader(save_folder=str(tmp_path / "ours"))[name]


def test_load_offloaded_weights_from_either_librarys_folder(tmp_path):
    source = make_net(1).cpu()
    state = {k: v for k, v in source.state_dict().items() if k != "head.weight"}
    acc.offload_state_dict(str(tmp_path / "acc"), state)
    hu.offload_state_dict(str(tmp_path / "hasten"), state)  # Accelerate's layout, as Accelerate's function
    from hasten.utils.offload import offload_to_safetensors

    offload_to_safetensors(str(tmp_path / "own"), state)  # hasten's own (safetensors) folder
    for folder in (tmp_path / "acc", tmp_path / "hasten", tmp_path / "own"):
        with init_empty_weights():
            model, reference = Net(), Net()
        index = json.loads((folder / "index.json").read_text())
        hu.load_offloaded_weights(model, index, str(folder))
        for key, value in model.state_dict().items():
            if key in state:  # load_offloaded_weights loads onto the CPU, as Accelerate
                assert value.device.type == "cpu" and torch.equal(value, state[key]), (folder, key)  # cpu-on-purpose
        if folder.name == "acc":  # the tie is left as Accelerate leaves it (head.weight not in the index)
            acc.load_offloaded_weights(reference, index, str(folder))
            assert {k: v.device for k, v in model.state_dict().items()} == \
                {k: v.device for k, v in reference.state_dict().items()}
    hu.load_offloaded_weights(model, {}, str(tmp_path))  # nothing to do
    with pytest.raises(NotImplementedError, match="bitsandbytes"):
        hu.load_offloaded_weights(model, {"body.0.weight": {}, "body.0.SCB": {}}, str(tmp_path))


def test_align_module_device_on_offloaded_and_plain_modules():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).to(DEVICE)
    want = {k: v.clone() for k, v in layer.state_dict().items()}
    assert not hu.has_offloaded_params(layer)
    add_hook_to_module(layer, AlignDevicesHook(execution_device=DEVICE, offload=True, io_same_device=True))
    assert hu.has_offloaded_params(layer) and layer.weight.device.type == "meta"
    for device in (None, "cpu"):
        with hu.align_module_device(layer, device):
            assert layer.weight.device.type == (device or DEVICE.type)
            assert torch.equal(layer.weight.cpu(), want["weight"].cpu())
        assert layer.weight.device.type == "meta" and layer._hf_hook.execution_device == DEVICE
    remove_hook_from_module(layer)
    add_hook_to_module(layer, AlignDevicesHook(execution_device=DEVICE))
    assert not hu.has_offloaded_params(layer)  # a hook that does not offload

    plain = nn.Linear(4, 3).to(DEVICE)
    before = plain.weight.detach().clone()
    with hu.align_module_device(plain, "cpu"):
        assert plain.weight.device.type == "cpu"  # cpu-on-purpose: aligned to "cpu"
        plain.weight.data.add_(1)  # changes made inside go back with the weight, as in Accelerate
    assert plain.weight.device == before.device and torch.equal(plain.weight.detach(), before + 1)
    with hu.align_module_device(plain):  # no device, no offload: nothing moves
        assert plain.weight.device == want["weight"].device
