"""``load_checkpoint_in_model`` into prepared (FSDP2, tensor-parallel) models built on ``meta``:
each process reads only its own slices of a transformers checkpoint (checks in
checks_shard_loading.py, on 2 real processes)."""

import os

import pytest
import torch

from distributed import run_checks

pytest.importorskip("transformers")


def _save(folder: str, tied: bool, intermediate: int = 64, max_shard_size=None):
    from transformers import LlamaForCausalLM

    import checks_shard_loading

    torch.manual_seed(0)
    model = LlamaForCausalLM(checks_shard_loading.llama_config(tied, intermediate))
    with torch.no_grad():  # make every weight count (norms start at one, biases absent)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    from safetensors.torch import load_file, save_file

    tmp = str(tmp_path_factory.mktemp("shard_loading"))
    model = _save(os.path.join(tmp, "tied"), True)
    # hasten's own save: checksums, and the tied name recorded as an alias (stored once)
    from hasten.saving import save_model

    save_model(model.state_dict(), os.path.join(tmp, "hasten_saved"), max_shard_size="40KB", is_main_process=True)
    _save(os.path.join(tmp, "tied_index"), True, max_shard_size="40KB")
    _save(os.path.join(tmp, "untied_index"), False, max_shard_size="40KB")
    _save(os.path.join(tmp, "wrong_shape"), False, intermediate=48)
    _save(os.path.join(tmp, "missing_key"), False)
    path = os.path.join(tmp, "missing_key", "model.safetensors")
    weights = load_file(path)
    del weights["model.norm.weight"]
    save_file(weights, path, metadata={"format": "pt"})
    for name in ("tied_index", "untied_index"):
        assert os.path.exists(os.path.join(tmp, name, "model.safetensors.index.json"))
    return tmp


@pytest.fixture(scope="module")
def two(checkpoints):
    return run_checks("checks_shard_loading", world_size=2, env={"SHARD_LOADING_TMP": checkpoints}, timeout=300)


def test_fsdp2_meta_model_filled_from_one_file_with_tied_embeddings(two):
    for r in two.assert_passed("check_fsdp2_tied_one_file"):
        assert "Shard(dim=0)" in r["placements"]


def test_fsdp2_meta_model_filled_from_hasten_save_model(two):
    two.assert_passed("check_fsdp2_hasten_saved")


def test_meta_buffer_that_no_checkpoint_holds_refused(two):
    for message in two.assert_passed("check_meta_buffer_refused"):
        assert message.startswith("CheckpointMismatchError"), message
        assert "model.rotary_emb.inv_freq" in message and "include_buffers" in message, message


def test_fsdp2_meta_model_filled_from_sharded_index(two):
    two.assert_passed("check_fsdp2_untied_index")
    two.assert_passed("check_fsdp2_tied_index")


def test_tp_meta_model_filled_from_sharded_index(two):
    for r in two.assert_passed("check_tp_untied_index"):
        assert r["placements"] == "(Shard(dim=1),)"  # row-wise: each process reads a strided block


@pytest.fixture(scope="module")
def four(checkpoints):
    return run_checks("checks_shard_loading", world_size=4, env={"SHARD_LOADING_TMP": checkpoints}, timeout=400,
                      only=["check_dp_shard_times_tp", "check_hsdp_tied"])


def test_dp_shard_times_tp_meta_model_filled(four):
    for r in four.assert_passed("check_dp_shard_times_tp"):
        assert "Shard(dim=1)" in r["placements"] and "Shard(dim=0)" in r["placements"], r


def test_hsdp_meta_model_filled_with_tied_embeddings(four):
    for r in four.assert_passed("check_hsdp_tied"):
        assert "Replicate()" in r["placements"], r


def test_missing_key_refused_on_every_process(two):
    for message in two.assert_passed("check_missing_key_refused"):
        assert message.startswith("CheckpointMismatchError"), message
        assert "model.norm.weight" in message and "missing_key" in message, message


def test_wrong_shape_refused_on_every_process(two):
    for message in two.assert_passed("check_wrong_shape_refused"):
        assert message.startswith("CheckpointMismatchError"), message
        assert "model.layers.0.mlp.up_proj.weight" in message and "[48, 32]" in message, message
        assert "model.safetensors" in message, message
