"""``hasten estimate-memory``: the arithmetic, models from local configs and class paths, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from hasten.commands.cli import main
from test_cli import one_line_error
from hasten.commands.memory_model import ModelSizes, estimate, fsdp2_shard


def test_arithmetic_per_strategy():
    # A Linear(3 -> 10) (weight 10x3, bias 10) and a frozen 5x2 table, one float buffer of 4, 8 int bytes.
    sizes = ModelSizes("m", trainable=[(30, 10), (10, 10)], frozen=[(10, 5)], float_buffers=4,
                       other_buffer_bytes=8, largest_layer=("lin", 40))
    fp32 = estimate(sizes, "float32", 4)
    steps = 2 * 4  # Adam's step counter per parameter tensor
    assert fp32["single"] == {"parameters": 50 * 4 + 16 + 8, "gradients": 160, "optimizer": 320 + steps,
                              "gathered_layer": 0, "total": 224 + 160 + 320 + steps}
    assert fp32["DDP"]["gradients"] == 2 * 160 and fp32["DDP"]["total"] == fp32["single"]["total"] + 160
    assert fp32["ZeRO-1"]["optimizer"] == 10 * 8 + steps and fp32["ZeRO-1"]["gradients"] == 160
    assert fp32["ZeRO-2"]["gradients"] == 40 and fp32["ZeRO-2"]["parameters"] == 224
    assert fp32["ZeRO-3"]["parameters"] == (10 + 3) * 4 + 24 and fp32["ZeRO-3"]["gathered_layer"] == 2 * 40 * 4
    # FSDP2 pads dim 0 to a multiple of 4: rows 3 of 10 -> 9 + 3 elements, 2 of 5 -> 4.
    assert fsdp2_shard(sizes.trainable, 4) == 12 and fsdp2_shard(sizes.frozen, 4) == 4
    assert fp32["FSDP2"]["parameters"] == 16 * 4 + 24 and fp32["FSDP2"]["optimizer"] == 12 * 8 + steps
    bf16 = estimate(sizes, "bfloat16", 4)
    assert bf16["single"]["parameters"] == 50 * 2 + 8 + 8 and bf16["single"]["optimizer"] == 40 * 12 + steps
    # The 16-byte rule: mixed precision costs as much per trainable parameter as float32.
    assert bf16["single"]["gradients"] + bf16["single"]["optimizer"] + 40 * 2 == 40 * 16 + steps
    assert estimate(sizes, "int4", 4) == {"load": {"parameters": 25 + 2 + 8, "gradients": 0, "optimizer": 0,
                                                   "gathered_layer": 0, "total": 35}}
    assert estimate(sizes, "float32", 1)["FSDP2"] == dict(fp32["single"], gathered_layer=0)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def run_json(capsys, *argv):
    assert main(["estimate-memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_local_transformers_config(configs, capsys, monkeypatch):
    from transformers import AutoConfig, LlamaForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = run_json(capsys, str(configs), "--num_processes", "2")
    real = LlamaForCausalLM(AutoConfig.from_pretrained(configs))
    count = sum(p.numel() for p in real.parameters())
    assert report["parameters"] == count and report["model"].endswith("(LlamaForCausalLM)")
    buffers = sum(b.numel() * 4 for b in real.buffers())
    fp32 = report["bytes_per_process"]["float32"]
    assert fp32["single"]["total"] == 16 * count + buffers + 4 * len(list(real.parameters()))
    assert set(report["bytes_per_process"]) == {"float32", "float16", "bfloat16", "int8", "int4"}
    # Untied 1000 x 64 embedding and head: the root group outweighs one decoder layer.
    assert report["largest_layer"]["name"].startswith("(root") and report["largest_layer"]["parameters"] == 128064
    from_file = run_json(capsys, str(configs / "config.json"), "--num_processes", "2")
    assert from_file["bytes_per_process"] == report["bytes_per_process"]
    smaller = run_json(capsys, str(configs), "--model_kwargs", '{"num_hidden_layers": 1}', "--dtypes", "int8")
    assert set(smaller["bytes_per_process"]) == {"int8"} and smaller["parameters"] < count
    assert main(["estimate-memory", str(configs), "--dtypes", "bfloat16", "float32"]) == 0
    table = capsys.readouterr().out
    assert "FSDP2" in table and "ZeRO-3" in table and "N = 8 processes" in table and "fp32 master copy" in table


def test_class_path(capsys):
    report = run_json(capsys, "torch.nn:Linear", "--model_kwargs", '{"in_features": 10, "out_features": 7}',
                      "--num_processes", "3", "--dtypes", "float32")
    rows = report["bytes_per_process"]["float32"]
    assert report["parameters"] == 77 and rows["single"]["optimizer"] == 77 * 8 + 2 * 4
    assert rows["FSDP2"]["parameters"] == (3 * 10 + 3) * 4  # 7 rows over 3 processes: 3 on rank 0
    assert report["largest_layer"] == {"name": "(root)", "parameters": 77,
                                       "rule": "the module with the most parameters of its own (no _no_split_modules)"}


def test_bad_input(configs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "broken.json").write_text("{not json")
    cases = [
        (["gpt2"], "never downloads"),
        (["meta-llama/Llama-3.1-8B"], "huggingface-cli download meta-llama/Llama-3.1-8B config.json"),
        ([str(tmp_path / "empty")], "has no config.json"),
        ([str(tmp_path / "weights.bin")], "is not a .json config"),
        ([str(tmp_path / "broken.json")], "cannot read the transformers config"),
        ([str(configs), "--num_processes", "0"], "--num_processes 0 must be at least 1"),
        ([str(configs), "--dtypes", "float64"], "--dtypes: 'float64' is not a choice"),
        ([str(configs), "--model_kwargs", "{oops"], "--model_kwargs '{oops' is not valid JSON"),
        ([str(configs), "--model_kwargs", "[1]"], "must be a JSON object"),
        ([str(configs), "--model_kwargs", '{"num_layerz": 1}'], "num_layerz are not settings of the LlamaConfig"),
        (["no_such_module_x:Model"], "cannot import 'no_such_module_x'"),
        (["torch.nn:NoSuch"], "'torch.nn' has no 'NoSuch'"),
        (["torch:float32"], "not a class"),
        (["torch.nn:Linear", "--model_kwargs", '{"bogus": 1}'], "cannot build torch.nn:Linear"),
        (["collections:OrderedDict"], "built a OrderedDict, not a torch.nn.Module"),
    ]
    for argv, fragment in cases:
        assert fragment in one_line_error(capsys, ["estimate-memory", *argv]), (argv, fragment)


def test_the_model_stays_on_meta(configs):
    from hasten.commands.estimate import build_model

    model, _ = build_model(str(configs))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert isinstance(model, torch.nn.Module)
