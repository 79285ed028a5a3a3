"""``hasten merge-weights``: DCP checkpoints written by 2 real FSDP2 processes, merged in a fresh
process without a process group, equal the full weights exactly; hasten checkpoints; bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_checks
from hasten.commands.cli import main
from test_cli import one_line_error

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@pytest.fixture(scope="module")
def sharded():
    report = run_checks("checks_merge_weights", world_size=2)
    values = report.assert_passed("check_fsdp2_dcp_checkpoints")
    assert values[0]["sharded"] == "DTensor"
    return values


def fresh_process_merge(*argv):
    """The command in a new interpreter with no launcher variables: no process group can exist."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "hasten.commands.cli", "merge-weights", *argv],
                          capture_output=True, text=True, env=env, timeout=300)


def reference(sharded):
    return load_file(os.path.join(sharded[0]["dir"], "reference.safetensors"))


def assert_same(merged, expected):
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        assert merged[name].dtype == value.dtype and torch.equal(merged[name], value), name


@pytest.mark.parametrize("kind", ["nested", "plain"])
def test_fsdp2_dcp_merges_to_the_full_weights(sharded, tmp_path, kind):
    out = tmp_path / "merged"
    result = fresh_process_merge(os.path.join(sharded[0]["dir"], kind), str(out))
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and os.listdir(out) == ["model.safetensors"]
    merged = load_file(out / "model.safetensors")
    assert not any("optimizer" in k or "exp_avg" in k for k in merged)
    assert_same(merged, reference(sharded))


def test_sharded_output_with_index_and_unsafe_serialization(sharded, tmp_path, capsys):
    from checks_merge_weights import tiny_gpt2

    from hasten.model_loading import load_checkpoint_in_model

    source = os.path.join(sharded[0]["dir"], "nested")
    assert main(["merge-weights", source, str(tmp_path / "shards"), "--max_shard_size", "20KB"]) == 0
    files = sorted(os.listdir(tmp_path / "shards"))
    assert "model.safetensors.index.json" in files and len(files) > 3, files
    model = tiny_gpt2()
    load_checkpoint_in_model(model, str(tmp_path / "shards"))
    expected = reference(sharded)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert main(["merge-weights", source, str(tmp_path / "bin"), "--unsafe_serialization"]) == 0
    assert os.listdir(tmp_path / "bin") == ["pytorch_model.bin"]
    assert_same(torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True), expected)


def _hasten_checkpoint_around(dcp_folder, folder, models=1):
    """A hasten checkpoint as sharded strategies write it: DCP shards in ``sharded/`` keyed
    ``model_<i>`` / ``optimizer_<i>``, the manifest naming each model's key."""
    from hasten.checkpointing import layout
    from hasten.files import reading as filereading

    shutil.copytree(dcp_folder, folder / "sharded")
    files = {f"sharded/{n}": {"size": os.path.getsize(folder / "sharded" / n),
                              "checksum": filereading.file_checksum(str(folder / "sharded" / n))}
             for n in os.listdir(folder / "sharded")}
    layout.write_manifest(str(folder), {"format": layout.FORMAT, "format_version": layout.FORMAT_VERSION, "files": files,
                                        "contents": {"models": [{"dcp": f"model_{i}"} for i in range(models)]}})


def test_hasten_sharded_checkpoint_and_remove_checkpoint_dir(sharded, tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint_3"
    checkpoint.mkdir()
    _hasten_checkpoint_around(os.path.join(sharded[0]["dir"], "hasten_layout"), checkpoint)
    assert main(["merge-weights", str(checkpoint), str(tmp_path / "out"), "--remove_checkpoint_dir"]) == 0
    assert not checkpoint.exists() and os.listdir(tmp_path) == ["out"]
    assert_same(load_file(tmp_path / "out" / "model.safetensors"), reference(sharded))
    # The DCP folder alone holds two models: one output folder each, the optimizer left out.
    assert main(["merge-weights", os.path.join(sharded[0]["dir"], "hasten_layout"), str(tmp_path / "two")]) == 0
    assert sorted(os.listdir(tmp_path / "two")) == ["model_0", "model_1"]
    for name in ("model_0", "model_1"):
        assert_same(load_file(tmp_path / "two" / name / "model.safetensors"), reference(sharded))


def test_fsdp2_shard_estimate_is_exact(sharded):
    from checks_merge_weights import tiny_gpt2

    from hasten.commands.estimate import measure
    from hasten.commands.memory_model import fsdp2_shard

    with torch.device("meta"):
        sizes = measure(tiny_gpt2(), "tiny")
    # Rank 0 holds the padded (largest) shard of every parameter; the estimate reports it.
    assert fsdp2_shard(sizes.trainable, 2) == sharded[0]["local_numel"] > sharded[1]["local_numel"]


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight


def test_hasten_checkpoint_of_two_models(tmp_path, fresh_state, capsys):
    from hasten import Accelerator
    from hasten.model_loading import load_checkpoint_in_model

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    first, second = acc.prepare(Tied(), torch.nn.Linear(3, 2))
    acc.save_state(str(tmp_path / "ck"))
    assert main(["merge-weights", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["model_0", "model_1"]
    twin = Tied()
    load_checkpoint_in_model(twin, str(tmp_path / "out" / "model_0"))
    for name, value in first.state_dict().items():
        assert torch.equal(twin.state_dict()[name], value), name
    assert_same(load_file(tmp_path / "out" / "model_1" / "model.safetensors"), second.state_dict())
    assert os.path.isdir(tmp_path / "ck")  # kept without --remove_checkpoint_dir


def test_bad_inputs(sharded, tmp_path, capsys):
    nested = os.path.join(sharded[0]["dir"], "nested")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text("{}")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "a_file").write_text("x")
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o")], "does not exist"),
        ([str(tmp_path / "a_file"), str(tmp_path / "o")], "is a file"),
        ([str(tmp_path / "config_only"), str(tmp_path / "o")], "is not a checkpoint"),
        ([nested, str(tmp_path / "full")], "already holds model.safetensors"),
        ([nested, str(tmp_path / "a_file")], "is a file"),
        ([nested, os.path.join(nested, "out")], "inside CHECKPOINT"),
        ([nested, str(tmp_path / "no" / "such" / "o")], "does not exist; create it first"),
        ([nested, str(tmp_path / "o"), "--max_shard_size", "ten"], "--max_shard_size 'ten' is not a size"),
        ([os.path.join(sharded[0]["dir"], "optimizer_only"), str(tmp_path / "o")], "holds no model weights"),
    ]
    for argv, fragment in cases:
        assert fragment in one_line_error(capsys, ["merge-weights", *argv]), (argv, fragment)
    assert not (tmp_path / "o").exists() and os.listdir(tmp_path / "full") == ["model.safetensors"]


def test_damaged_checkpoints_are_refused(sharded, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(sharded[0]["dir"], "nested"), broken)
    os.remove(broken / "__1_0.distcp")
    assert "incomplete or damaged" in one_line_error(capsys, ["merge-weights", str(broken), str(tmp_path / "o")])
    (broken / ".metadata").write_bytes(b"not a pickle")
    assert "cannot read the DCP metadata" in one_line_error(capsys, ["merge-weights", str(broken), str(tmp_path / "o")])
    ck = tmp_path / "ck"
    ck.mkdir()
    _hasten_checkpoint_around(os.path.join(sharded[0]["dir"], "hasten_layout"), ck, models=3)
    err = one_line_error(capsys, ["merge-weights", str(ck), str(tmp_path / "o")])
    assert "holds no entry 'model_2'" in err and not (tmp_path / "o").exists()  # checked before writing
    os.remove(ck / "sharded" / "__0_0.distcp")
    err = one_line_error(capsys, ["merge-weights", str(ck), str(tmp_path / "o")])
    assert "is incomplete: missing files: sharded/__0_0.distcp" in err


def test_tampered_metadata_is_refused_before_it_runs(sharded, tmp_path, capsys):
    """Issue #18 item 1: a .metadata replaced by a pickle that opens a file is refused (one line, exit 2),
    naming the file and the global, and the file is never created; the same folder merges untampered."""
    from distributed import evil_pickle

    evil, marker = tmp_path / "evil", tmp_path / "created_by_a_pickle"
    shutil.copytree(os.path.join(sharded[0]["dir"], "nested"), evil)
    (evil / ".metadata").write_bytes(evil_pickle(str(marker)))
    err = one_line_error(capsys, ["merge-weights", str(evil), str(tmp_path / "o")])
    assert not marker.exists(), err
    assert str(evil / ".metadata") in err and "io.open" in err and "tampered" in err, err
    assert not (tmp_path / "o").exists()
    shutil.copy(os.path.join(sharded[0]["dir"], "nested", ".metadata"), evil / ".metadata")
    assert main(["merge-weights", str(evil), str(tmp_path / "o")]) == 0
    assert_same(load_file(tmp_path / "o" / "model.safetensors"), reference(sharded))


def test_wrapper_prefixes_are_removed():
    from hasten.commands.merge import strip_wrappers

    assert strip_wrappers("module._orig_mod.layers.0._fsdp_wrapped_module.attn.weight") == "layers.0.attn.weight"
    assert strip_wrappers("layers.0._checkpoint_wrapped_module.mlp.bias") == "layers.0.mlp.bias"
    assert strip_wrappers("encoder.module.weight") == "encoder.module.weight"  # a real submodule named module


def test_help_does_not_import_torch():
    code = ("import sys\nfrom hasten.commands.cli import main\n"
            "for argv in (['merge-weights', '--help'], ['estimate-memory', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
            "assert 'torch' not in sys.modules\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=SRC))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
