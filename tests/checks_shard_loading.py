"""Loading a transformers checkpoint straight into a prepared (sharded) model, on 2 processes
(see distributed.py and test_shard_loading.py).

The model is built under ``init_empty_weights()`` on every process (process 0 included), prepared
under FSDP2 or tensor parallelism, then filled by ``load_checkpoint_in_model(model, folder)``. The
folders are written by the test with ``save_pretrained`` (tied and untied embeddings, one file and
an index of several).
"""

import os

import torch

from distributed import reset_state
from hasten import Accelerator, init_empty_weights, load_checkpoint_in_model
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from hasten.utils.parallelism_config import ParallelismConfig


def llama_config(tied: bool, intermediate: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=tied)


def _folder(name: str) -> str:
    return os.path.join(os.environ["SHARD_LOADING_TMP"], name)


def _ids(device) -> torch.Tensor:
    return torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(3)).to(device)


def _plain(folder: str, device):
    """The reference: the checkpoint loaded whole, in this process, without any parallelism."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder).to(device)
    return model


def _empty(tied: bool):
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(llama_config(tied))
    assert all(p.is_meta for p in model.parameters())
    return model


def _fsdp2() -> Accelerator:
    reset_state()
    return Accelerator(fsdp_plugin=Plugin(fsdp_version=2, cpu_ram_efficient_loading=True,
                                          auto_wrap_policy="TRANSFORMER_BASED_WRAP"))


def _tp() -> Accelerator:
    reset_state()
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"  # how TP alone asks for meta models (as Accelerate)
    try:
        return Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    finally:
        del os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"]


def _layout(**sizes) -> Accelerator:
    """FSDP2 over a 2-D mesh of 4 processes (dp_shard x tp, or HSDP)."""
    reset_state()
    return Accelerator(parallelism_config=ParallelismConfig(**sizes),
                       fsdp_plugin=Plugin(fsdp_version=2, cpu_ram_efficient_loading=True,
                                          auto_wrap_policy="TRANSFORMER_BASED_WRAP"))


def _same_as_real(make, name: str, tied: bool) -> dict:
    """Loaded from meta == the same layout prepared from the real model: weights and logits, bitwise."""
    acc = make()
    model, folder = _loaded(acc, name, tied)
    _same_weights(acc, model, folder)
    real = make().prepare(_plain(folder, "cpu"))  # cpu-on-purpose: prepare places it
    with torch.no_grad():
        got, want = model(_ids(acc.device)).logits, real(_ids(acc.device)).logits
    assert torch.equal(got, want), float((got - want).abs().max())
    return {"placements": str(model.model.layers[0].mlp.down_proj.weight.placements)}


def _loaded(acc: Accelerator, name: str, tied: bool, reference: str = ""):
    model = acc.prepare(_empty(tied))
    assert any(p.is_meta for p in model.parameters()), "prepare filled the model itself"
    load_checkpoint_in_model(model, _folder(name))
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    return model, _folder(reference or name)


def _same_weights(acc, model, folder) -> None:
    full = acc.strategy.model_state_dict(model, everyone=True)
    ref = _plain(folder, "cpu").state_dict()  # cpu-on-purpose: full state dicts are gathered on CPU
    assert sorted(full) == sorted(ref), (sorted(full), sorted(ref))
    different = [k for k in ref if not torch.equal(full[k].cpu(), ref[k])]
    assert not different, different


def _fsdp2_case(name: str, tied: bool, reference: str = "") -> dict:
    acc = _fsdp2()
    model, folder = _loaded(acc, name, tied, reference)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "the tie was lost"
    _same_weights(acc, model, folder)
    plain = _plain(folder, acc.device)
    with torch.no_grad():
        got, want = model(_ids(acc.device)).logits, plain(_ids(acc.device)).logits
    assert torch.equal(got, want), float((got - want).abs().max())
    rotary = model.model.rotary_emb.inv_freq
    assert torch.equal(rotary, plain.model.rotary_emb.inv_freq)
    # the model trains: one step changes the weights on every process alike
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(_ids(acc.device), labels=_ids(acc.device)).loss)
    opt.step()
    return {"placements": str(model.model.layers[0].mlp.up_proj.weight.placements)}


def check_fsdp2_tied_one_file():
    return _fsdp2_case("tied", True)


def check_fsdp2_hasten_saved():
    return _fsdp2_case("hasten_saved", True, reference="tied")


def check_meta_buffer_refused():
    from transformers import LlamaForCausalLM

    acc = _fsdp2()
    with init_empty_weights(include_buffers=True):
        model = LlamaForCausalLM(llama_config(True))
    model = acc.prepare(model)
    try:
        load_checkpoint_in_model(model, _folder("tied"))
    except Exception as e:  # noqa: BLE001 - the kind and message are judged by the test
        return f"{type(e).__name__}: {e}"
    raise AssertionError("loaded although inv_freq has no value")


def check_fsdp2_untied_index():
    return _fsdp2_case("untied_index", False)


def check_fsdp2_tied_index():
    return _fsdp2_case("tied_index", True)


def check_tp_untied_index():
    if int(os.environ["WORLD_SIZE"]) != 2:
        return None
    return _same_as_real(_tp, "untied_index", False)


def check_dp_shard_times_tp():
    if int(os.environ["WORLD_SIZE"]) != 4:
        return None
    return _same_as_real(lambda: _layout(dp_shard_size=2, tp_size=2), "untied_index", False)


def check_hsdp_tied():
    if int(os.environ["WORLD_SIZE"]) != 4:
        return None
    return _same_as_real(lambda: _layout(dp_replicate_size=2, dp_shard_size=2), "tied_index", True)


def _refused(name: str, tied: bool) -> str:
    acc = _fsdp2()
    model = acc.prepare(_empty(tied))
    try:
        load_checkpoint_in_model(model, _folder(name))
    except Exception as e:  # noqa: BLE001 - the kind and message are judged by the test
        acc.wait_for_everyone()  # no process was left in a collective
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{name} loaded")


def check_missing_key_refused():
    return _refused("missing_key", False)


def check_wrong_shape_refused():
    return _refused("wrong_shape", False)
