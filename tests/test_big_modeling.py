"""Big-model inference: a tiny tied-embedding Llama saved in shards, loaded empty and dispatched over the
execution device, CPU RAM and disk; outputs must equal the plain model's.

Runs on CPU (CPU + disk offload) and, where a GPU is visible, on GPU + CPU + disk.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hasten import (  # noqa: E402
    PartialState,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from hasten.saving import save_model  # noqa: E402
from hasten.utils import find_tied_parameters  # noqa: E402
from hasten.utils.modeling import compute_module_sizes  # noqa: E402

DEVICE = PartialState().default_device
ON_GPU = DEVICE.type != "cpu"
LAYER = "LlamaDecoderLayer"
CONFIG = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=True)


def empty_llama() -> nn.Module:
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.tie_weights()  # transformers leaves meta models untied
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint folder with 8 shards, input ids, the plain model on the execution device)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    folder = tmp_path_factory.mktemp("ckpt")
    save_model(model.state_dict(), folder, max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 8
    return folder, torch.randint(0, CONFIG["vocab_size"], (2, 12)), model.to(DEVICE)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(DEVICE)).logits


def memory_forcing_disk() -> dict:
    # CPU alone: embeddings and two layers fit in RAM, the rest goes to disk. With a GPU: the
    # embeddings and one layer on it, one layer in RAM, the rest on disk.
    return {0: 600_000, "cpu": 300_000} if ON_GPU else {"cpu": 700_000}


MIXED_MAP = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
             "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "disk", "model.rotary_emb": "cpu"}
if ON_GPU:
    MIXED_MAP = {**MIXED_MAP, "model.embed_tokens": 0, "lm_head": 0, "model.layers.3": 0}


@pytest.mark.parametrize("device_map", ["auto", "balanced", "sequential", "dict"])
def test_dispatched_sharded_checkpoint_gives_the_plain_models_logits(saved, tmp_path, device_map):
    folder, ids, plain = saved
    plan = MIXED_MAP if device_map == "dict" else device_map
    model = load_checkpoint_and_dispatch(empty_llama(), folder, device_map=plan, max_memory=memory_forcing_disk(),
                                         no_split_module_classes=[LAYER], offload_folder=tmp_path / "offload")
    placed = model.hf_device_map
    assert "disk" in placed.values() and set(placed.values()) - {"disk"}, placed
    assert any(str(d) == "cpu" for d in placed.values()) or not ON_GPU
    assert torch.equal(logits(model, ids), logits(plain, ids))
    assert torch.equal(logits(model, ids), logits(plain, ids))  # a second forward: weights reloaded alike
    # ties survive loading, dispatch and forwards: one object, one storage
    assert find_tied_parameters(model) == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    index = json.loads((tmp_path / "offload" / "index.json").read_text())
    on_disk = [n for n in plain.state_dict() if any(n.startswith(m + ".") for m, d in placed.items() if d == "disk")]
    assert on_disk and set(on_disk) <= set(index)
    assert all(model.get_parameter(n).device.type == "meta" for n in on_disk if n.endswith("weight"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_casts_weights_and_matches_the_cast_model(saved, tmp_path, dtype):
    folder, ids, plain = saved
    half = {k: v // 2 for k, v in memory_forcing_disk().items()}  # the planner counts 2-byte weights
    model = load_checkpoint_and_dispatch(empty_llama(), folder, device_map="auto", max_memory=half,
                                         no_split_module_classes=[LAYER], offload_folder=tmp_path, dtype=dtype)
    assert "disk" in model.hf_device_map.values()
    assert model.model.embed_tokens.weight.dtype == dtype
    index = json.loads((tmp_path / "index.json").read_text())
    assert {entry["dtype"] for entry in index.values()} == {str(dtype).replace("torch.", "")}
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    reference.load_state_dict(plain.state_dict())
    reference = reference.to(DEVICE)
    for param in reference.parameters():  # the weights are cast; buffers (rotary inv_freq) stay float32
        param.data = param.data.to(dtype)
    got, want = logits(model, ids), logits(reference, ids)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # same weights, same dtype, same kernels
    # and close to the float32 model
    torch.testing.assert_close(got.float(), logits(plain, ids), rtol=0.05, atol=0.02)


def test_tied_weights_offloaded_to_disk_together(saved, tmp_path):
    folder, ids, plain = saved
    plan = {"model.embed_tokens": "disk", "lm_head": "disk", "model.layers": "cpu", "model.norm": "cpu",
            "model.rotary_emb": "cpu"}
    model = load_checkpoint_and_dispatch(empty_llama(), folder, device_map=plan, offload_folder=tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    # one stored copy serves both names
    assert index["lm_head.weight"] == index["model.embed_tokens.weight"]
    assert len(list(tmp_path.glob("offload-*.safetensors"))) == 1
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.device.type == "meta"
    assert torch.equal(logits(model, ids), logits(plain, ids))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one object after a forward

    split = dict(plan, lm_head="cpu")
    with pytest.raises(ValueError, match="tied weights .* 'disk' and to other devices"):
        load_checkpoint_and_dispatch(empty_llama(), folder, device_map=split, offload_folder=tmp_path / "x")


def test_bad_plan_names_and_missing_folder(saved):
    folder, _, _ = saved
    with pytest.raises(ValueError, match="device_map='fastest' is not a plan"):
        load_checkpoint_and_dispatch(empty_llama(), folder, device_map="fastest")
    with pytest.raises(ValueError, match="pass offload_folder="):
        load_checkpoint_and_dispatch(empty_llama(), folder, device_map={"": "disk"})
    with pytest.raises(ValueError, match="no device for"):
        dispatch_model(empty_llama(), {"model": "cpu"})


# -- planning ---------------------------------------------------------------------------------------
def test_plan_respects_budgets_blocks_and_ties():
    model = empty_llama()
    sizes = compute_module_sizes(model)
    layer = sizes["model.layers.0"]
    budget = {"cpu": sizes["model.embed_tokens"] + 3 * layer}
    plan = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=[LAYER], clean_result=False)
    assert all(not k.startswith("model.layers.0.") for k in plan)  # blocks are never split
    assert plan["lm_head"] == plan["model.embed_tokens"]  # ties together
    in_ram = sum(sizes[k] for k, d in plan.items() if d == "cpu")
    assert in_ram + layer <= budget["cpu"]  # room kept to stage one offloaded layer
    assert [k for k, d in plan.items() if d == "disk"] == ["model.layers.2", "model.layers.3", "model.norm",
                                                            "model.rotary_emb"]
    split = infer_auto_device_map(model, max_memory=budget, clean_result=False)
    assert any(k.startswith("model.layers.2.") for k in split)  # without the rule, layers are split


def test_plan_keeps_ties_with_a_later_module():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(8, 8, bias=False)
            self.middle = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            self.last = nn.Linear(8, 8, bias=False)
            self.last.weight = self.first.weight

    with init_empty_weights():
        net = Net()
    assert net.last.weight is net.first.weight  # a tie made while building survives init_empty_weights
    weight, linear = 8 * 8 * 4, (8 * 8 + 8) * 4
    plan = infer_auto_device_map(net, max_memory={0: weight + linear, "cpu": 10**6}, clean_result=False)
    assert plan["first"] == plan["last"]


@pytest.mark.filterwarnings("ignore:Current model requires")
def test_plans_match_accelerate():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from hasten.utils import get_balanced_memory

    logging.getLogger("accelerate").setLevel(logging.ERROR)
    model = empty_llama()
    total = compute_module_sizes(model)[""]
    for no_split in (None, [LAYER]):
        for gpu in (None, 0.1, 0.3):
            for cpu in (0.05, 0.4, 0.8, 1.5):
                for dtype in (None, torch.float16):
                    budget = {"cpu": int(total * cpu)}
                    if gpu is not None:
                        budget = {0: int(total * gpu), 1: int(total * gpu), **budget}
                    args = dict(no_split_module_classes=no_split, dtype=dtype)
                    for fallback in (False, True) if gpu is not None and dtype is None else (False,):
                        plan = dict(args, fallback_allocation=fallback)
                        assert infer_auto_device_map(model, dict(budget), **plan) == dict(
                            accelerate_utils.infer_auto_device_map(model, dict(budget), **plan)), (budget, plan)
                    theirs = accelerate_utils.get_balanced_memory(model, dict(budget), **args)
                    assert get_balanced_memory(model, dict(budget), **args) == {k: int(v) for k, v in theirs.items()}
