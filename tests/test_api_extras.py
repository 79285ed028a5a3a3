"""The smaller public API that Accelerate scripts use: environment patching, config writing, DeepSpeed
placeholders, torch.compile settings (regional compilation), Accelerator arguments and decorators,
loading weights into a model with a device map or dtype. One process; see test_api_distributed.py
for the collectives."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from hasten import Accelerator
from hasten.commands.config import default_config
from hasten.commands.config_schema import read_config
from hasten.model_loading import load_checkpoint_in_model
from hasten.saving import save_model
from hasten.utils import (
    DummyOptim,
    DummyScheduler,
    DynamoBackend,
    TorchDynamoPlugin,
    patch_environment,
    write_basic_config,
)
from hasten.utils.operations import copy_tensor_to_devices

pytestmark = pytest.mark.usefixtures("fresh_state")


# -- patch_environment ------------------------------------------------------------------------------
def test_patch_environment_upper_cases_stringifies_and_restores(monkeypatch):
    monkeypatch.setenv("HASTEN_API_OLD", "before")
    monkeypatch.delenv("HASTEN_API_NEW", raising=False)
    with patch_environment(hasten_api_old=1, hasten_api_new=2.5):
        assert os.environ["HASTEN_API_OLD"] == "1" and os.environ["HASTEN_API_NEW"] == "2.5"
        assert "hasten_api_old" not in os.environ
    assert os.environ["HASTEN_API_OLD"] == "before" and "HASTEN_API_NEW" not in os.environ
    with pytest.raises(KeyError), patch_environment(hasten_api_new="x"):
        raise KeyError("the block fails")
    assert "HASTEN_API_NEW" not in os.environ


# -- write_basic_config -----------------------------------------------------------------------------
def test_write_basic_config_writes_once_what_config_default_writes(tmp_path, capsys):
    target = tmp_path / "sub" / "config.yaml"
    written = write_basic_config("BF16", save_location=str(target))
    assert written == target and target.is_file()
    assert read_config(str(target)) == read_config_of(tmp_path, default_config("bf16"))
    before = target.read_bytes()
    assert write_basic_config("fp16", save_location=str(target)) is False
    assert target.read_bytes() == before and "already exists" in capsys.readouterr().out
    with pytest.raises(ValueError, match="'fp32'.*bf16"):
        write_basic_config("fp32", save_location=str(tmp_path / "other.yaml"))
    assert not (tmp_path / "other.yaml").exists()


def read_config_of(tmp_path, cfg):
    from hasten.commands.config_schema import write_config

    return read_config(write_config(str(tmp_path / "reference.yaml"), cfg))


def test_write_basic_config_default_location_follows_hasten_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path / "from-env.yaml"))
    assert write_basic_config() == tmp_path / "from-env.yaml"
    assert read_config(str(tmp_path / "from-env.yaml"))["mixed_precision"] == "no"


# -- DeepSpeed placeholders -------------------------------------------------------------------------
def test_dummy_optimizer_and_scheduler_keep_their_arguments_and_are_refused_without_deepspeed():
    model = nn.Linear(3, 1)
    opt = DummyOptim(model.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.99))
    sched = DummyScheduler(opt, total_num_steps=10, warmup_num_steps=2, custom=1)
    assert (opt.lr, opt.weight_decay, opt.kwargs) == (0.01, 0.1, {"betas": (0.9, 0.99)})
    assert (sched.optimizer, sched.total_num_steps, sched.warmup_num_steps, sched.kwargs) == (opt, 10, 2, {"custom": 1})
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=r"DummyOptim \(argument 1\).*DeepSpeed config.*'optimizer'.*torch.optim"):
        acc.prepare(model, opt)
    with pytest.raises(ValueError, match=r"DummyScheduler \(argument 0\).*'scheduler'"):
        acc.prepare(sched)
    assert acc._models == []  # refused before anything was prepared


# -- TorchDynamoPlugin --------------------------------------------------------------------------------
def test_dynamo_plugin_defaults_and_environment():
    plain = TorchDynamoPlugin()
    assert (plain.backend, plain.mode, plain.fullgraph, plain.dynamic, plain.use_regional_compilation) == \
        ("no", "default", False, None, False)
    with patch_environment(hasten_dynamo_backend="EAGER", accelerate_dynamo_use_regional_compilation="true",
                           hasten_dynamo_use_fullgraph="1", hasten_dynamo_mode="max-autotune"):
        from_env = TorchDynamoPlugin()
    assert (from_env.backend, from_env.use_regional_compilation, from_env.fullgraph, from_env.mode) == \
        ("eager", True, True, "max-autotune")
    assert TorchDynamoPlugin(backend=DynamoBackend.AOT_EAGER).backend == "aot_eager"
    kwargs = TorchDynamoPlugin(backend="eager", use_regional_compilation=True).to_compile_kwargs()
    assert kwargs == {"backend": "eager", "fullgraph": False, "dynamic": None}  # "default" mode is torch's own
    with pytest.raises(ValueError, match="dynamo_backend or dynamo_plugin"):
        Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="eager"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class Stack(nn.Module):
    def __init__(self, depth=4):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_regional_compilation_compiles_each_block_once_and_keeps_the_module():
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, reference = Stack(), Stack()
    reference.load_state_dict(model.state_dict())
    acc = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend=counting_backend, use_regional_compilation=True))
    prepared = acc.prepare(model)
    assert prepared is model and not hasattr(prepared, "_orig_mod")  # compiled in place: same keys, same object
    assert all(block._compiled_call_impl is not None for block in prepared.blocks)
    assert prepared._compiled_call_impl is None  # the outer forward stays eager
    x = torch.randn(5, 4)
    out = prepared(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert len(graphs) == 1  # four blocks, one trace: the others reuse it
    prepared(torch.randn(5, 4))
    assert len(graphs) == 1
    assert list(acc.unwrap_model(prepared).state_dict()) == list(reference.state_dict())
    out.sum().backward()
    assert all(p.grad is not None for p in prepared.parameters())


def test_whole_model_compilation_without_regional_flag():
    torch._dynamo.reset()
    acc = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    prepared = acc.prepare(Stack())
    assert hasattr(prepared, "_orig_mod") and isinstance(acc.unwrap_model(prepared, keep_torch_compile=False), Stack)


# -- Accelerator arguments and facts ----------------------------------------------------------------
def test_accelerator_positional_arguments_follow_accelerate():
    with pytest.warns(FutureWarning, match="split_batches"):
        acc = Accelerator(True, True, "no", 2, True)  # device_placement, split_batches, precision, steps, cpu
    # cpu-on-purpose: the fifth positional argument is cpu=True
    assert acc.split_batches is True and acc.gradient_accumulation_steps == 2 and acc.device.type == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # leaving split_batches out warns about nothing
        assert Accelerator(cpu=True).split_batches is False
    with pytest.raises(TypeError, match="megatron_lm_plugin must be a hasten.utils.MegatronLMPlugin"):
        Accelerator(cpu=True, megatron_lm_plugin=object())
    with pytest.raises(TypeError, match="torch_tp_plugin must be a TorchTensorParallelPlugin"):
        Accelerator(cpu=True, torch_tp_plugin=object())
    with pytest.raises(TypeError, match="parallelism_config must be a hasten.utils.ParallelismConfig"):
        Accelerator(cpu=True, parallelism_config=object())
    with pytest.raises(TypeError):
        Accelerator(True, False, "no", 1, True, None, None, None, None, None, None, None, None, None, None, True,
                    None, None, None, None, None, "auto")  # resume is keyword-only


def test_layout_ranks_come_from_the_parallelism_config_mesh():
    from hasten.utils import ParallelismConfig

    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    assert acc.parallelism_config is not None and acc.torch_device_mesh is None  # one process: no mesh to build
    ranks = (acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank, acc.context_parallel_rank)
    assert ranks == (0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="not configured"):
        acc.pipeline_parallel_rank  # noqa: B018


def test_accelerator_layout_facts_on_one_process():
    acc = Accelerator(cpu=True)
    assert acc.multi_device is False and acc.is_fsdp2 is False and acc.deepspeed_plugin is None
    assert acc.parallelism_config is None and acc.torch_device_mesh is None and acc.should_save_model is True
    assert acc.use_stateful_dataloader is False
    with pytest.raises(RuntimeError, match="not configured"):
        acc.data_parallel_rank  # noqa: B018
    model = nn.Linear(2, 2)
    assert acc.verify_device_map(model) is False
    model.hf_device_map = {"a": 0, "b": "cpu"}
    assert acc.verify_device_map(model) is True


def test_decorators_on_one_process_run_everything():
    acc = Accelerator(cpu=True)
    calls = []
    acc.on_main_process(lambda: calls.append("main"))()
    acc.on_main_process()(lambda: calls.append("main()"))()
    acc.on_local_main_process()(lambda: calls.append("local()"))()
    acc.on_process(process_index=1)(lambda: calls.append("p1"))()  # one process: runs, as in Accelerate
    acc.on_local_process(lambda: calls.append("l1"), local_process_index=1)()
    assert calls == ["main", "main()", "local()", "p1", "l1"]

    @acc.on_main_process
    def value():
        return 42

    assert value() == 42 and value.__name__ == "value"
    with pytest.raises(ValueError, match="process_index=None"):
        acc.on_process(lambda: None)


def test_copy_tensor_to_devices_on_one_process():
    t = torch.arange(3)
    assert copy_tensor_to_devices(t) is t
    with pytest.raises(ValueError, match="None on the only process"):
        copy_tensor_to_devices(None)
    with pytest.raises(TypeError, match="list"):
        copy_tensor_to_devices([1, 2])


# -- load_checkpoint_in_model: Accelerate's options ---------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))


def saved_tied(tmp_path):
    torch.manual_seed(3)
    source = Tied()
    source.steps += 7
    save_model(source.state_dict(), tmp_path)
    return source


def test_load_into_meta_model_with_device_map_keeps_ties(tmp_path):
    source = saved_tied(tmp_path)
    with torch.device("meta"):
        empty = Tied()
    load_checkpoint_in_model(empty, tmp_path, device_map={"": "cpu"})
    assert all(t.device.type == "cpu" for t in [*empty.parameters(), *empty.buffers()])  # cpu-on-purpose: device_map
    assert empty.out.weight is empty.embed.weight  # the tie survives the replacement
    for name, value in source.state_dict().items():
        assert torch.equal(empty.state_dict()[name], value), name
    assert isinstance(empty.embed.weight, nn.Parameter) and empty.embed.weight.requires_grad
    assert empty.steps.item() == 7


def test_load_with_dtype_keeps_fp32_modules_and_copies_in_place_otherwise(tmp_path):
    source = saved_tied(tmp_path)
    half = Tied()
    load_checkpoint_in_model(half, tmp_path, dtype=torch.float16, keep_in_fp32_modules=["norm"])
    assert half.embed.weight.dtype == torch.float16 and half.norm.weight.dtype == torch.float32
    assert half.steps.dtype == torch.long  # integers are never cast
    torch.testing.assert_close(half.embed.weight.float(), source.embed.weight, rtol=1e-3, atol=1e-3)
    plain = Tied()
    param = plain.norm.weight
    load_checkpoint_in_model(plain, tmp_path, dtype="float32")
    assert plain.norm.weight is param  # same device and dtype: copied into the existing parameter
    assert torch.equal(param, source.norm.weight)


def test_load_device_map_must_cover_every_tensor_and_disk_needs_a_folder(tmp_path):
    saved_tied(tmp_path)
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="no device for 'steps'"):
        load_checkpoint_in_model(model, tmp_path, device_map={"embed": "cpu", "out": "cpu"})
    with pytest.raises(ValueError, match="sends 'norm' to 'disk'; pass offload_folder="):
        load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu", "norm": "disk"})
    with pytest.raises(NotImplementedError, match="offload_8bit_bnb"):
        load_checkpoint_in_model(model, tmp_path, offload_8bit_bnb=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing changed
    load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu", "norm": "disk"}, offload_folder=tmp_path / "off")
    assert model.norm.weight.device.type == "meta" and (tmp_path / "off" / "index.json").is_file()
    load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu", "norm": "cpu"}, offload_state_dict=True)
