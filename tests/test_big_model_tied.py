"""Big-model loading of checkpoints saved by current transformers (5.x), as the README shows it.

transformers 5 leaves a tied ``lm_head.weight`` out of the file; a model built under
``init_empty_weights`` and tied with ``tie_weights()`` must come out tied, with nothing left on
``meta``, and compute what the saved model computed, whichever way it is loaded.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hasten import init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model  # noqa: E402


def _config(tied: bool):
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved(request, tmp_path_factory):
    tied = request.param
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_config(tied)).eval()
    folder = tmp_path_factory.mktemp("tied" if tied else "untied")
    reference.save_pretrained(folder / "single")
    reference.save_pretrained(folder / "sharded", max_shard_size="20KB")
    return tied, reference, folder


def _empty(tied):
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(_config(tied))
    model.tie_weights()
    return model


def _check(model, reference, tied, on_disk=()):
    still_meta = [n for n, p in model.named_parameters(remove_duplicate=False)
                  if p.is_meta and not n.startswith(on_disk or ("\0",))]
    assert not still_meta and not [n for n, b in model.named_buffers() if b.is_meta], still_meta
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_load_checkpoint_in_model_keeps_ties_and_loads_everything(saved, layout):
    tied, reference, folder = saved
    if tied:  # the file really lacks the tied name (the case that left it on meta)
        from safetensors import safe_open

        if layout == "single":
            with safe_open(str(folder / "single" / "model.safetensors"), "pt") as f:
                assert "lm_head.weight" not in f.keys()
    model = _empty(tied)
    missing, unexpected = load_checkpoint_in_model(model, str(folder / layout))
    assert missing == [] and unexpected == []
    _check(model, reference, tied)


@pytest.mark.parametrize("device_map", ["auto", "cpu_and_disk"])
def test_load_checkpoint_and_dispatch_as_the_readme_shows(saved, device_map, tmp_path):
    tied, reference, folder = saved
    model = _empty(tied)
    if device_map == "cpu_and_disk":
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = load_checkpoint_and_dispatch(model, str(folder / "sharded"), device_map=device_map,
                                         no_split_module_classes=["LlamaDecoderLayer"],
                                         offload_folder=str(tmp_path / "offload"))
    _check(model, reference, tied, on_disk=("model.layers.1.",))


def test_device_map_auto_works_without_psutil(tmp_path):
    """psutil is not a dependency: the host's available memory is read without it."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['psutil'] = None\n")
    script = textwrap.dedent("""
        import torch
        from hasten.utils import get_max_memory
        try:
            import psutil
        except ImportError:
            pass
        else:
            raise SystemExit("psutil was importable")
        memory = get_max_memory()
        assert memory["cpu"] > 0, memory
        print("ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), os.path.join(root, "src")]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_a_device_map_naming_an_absent_gpu_is_one_clear_error(saved):
    """Planning for another machine is fine (max_memory may name GPUs this one lacks), but dispatching
    there raises before anything moves, naming the module and the GPU, instead of torch's
    "Torch not compiled with CUDA enabled" half-way through."""
    tied, _, folder = saved
    model = _empty(tied)
    with pytest.raises(ValueError, match="on GPU 0; 0 CUDA device"):
        load_checkpoint_and_dispatch(model, str(folder / "single"), device_map={"": 0})
