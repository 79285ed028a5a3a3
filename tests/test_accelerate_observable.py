"""Where hasten behaved differently from Accelerate 1.15 for the same call and now does as Accelerate does
(the rule: what hasten adds is invisible to code written for Accelerate). Each test states Accelerate's
observable behaviour and, where hasten keeps a stronger one, that it still holds.

Where cheap, the installed ``accelerate`` answers the same call and the two are compared.
"""

from __future__ import annotations

from unittest import mock

import pytest

from hasten.utils import ParallelismConfig

LAYOUTS = [(8, 1, 1, 1), (1, 8, 1, 1), (2, 4, 1, 1), (1, 4, 2, 1), (2, 2, 2, 1), (1, 1, 8, 1), (1, 1, 1, 4),
           (1, 4, 1, 2), (1, 2, 2, 2), (2, 2, 2, 2)]


def _sizes(layout: tuple) -> dict:
    return dict(zip(("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"), layout))


class RecordingMesh:
    """What torch's ``init_device_mesh`` returns, reduced to what the caller does with it: slice and flatten."""

    def __init__(self, device_type: str, shape: tuple, mesh_dim_names: tuple) -> None:
        self.device_type, self.shape, self.mesh_dim_names = device_type, shape, mesh_dim_names
        self.flattened: list = []

    def __getitem__(self, names):
        outer = self

        class Sub:
            def _flatten(self, name):
                outer.flattened.append((names, name))

        return Sub()


def _build(module, layout, monkeypatch) -> tuple:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = module.ParallelismConfig(**_sizes(layout))
    with mock.patch("torch.distributed.device_mesh.init_device_mesh", side_effect=RecordingMesh) as init:
        mesh = config.build_device_mesh("cpu")  # cpu-on-purpose: the mesh is recorded, not built
    return init.call_count, mesh.device_type, mesh.shape, mesh.mesh_dim_names, mesh.flattened, config


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mesh_names_shape_and_flattening_are_accelerates(layout, monkeypatch) -> None:
    accelerate = pytest.importorskip("accelerate.parallelism_config")
    config = ParallelismConfig(**_sizes(layout))
    reference = accelerate.ParallelismConfig(**_sizes(layout))
    assert config._get_mesh() == reference._get_mesh()
    for view in ("dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names", "dp_cp_dim_names", "fsdp_dim_names"):
        assert sorted(getattr(config, view)) == sorted(getattr(reference, view)), view
        assert type(getattr(config, view)) is list
    # A job of one process, with torch's mesh builder replaced (Accelerate's own tests do this): the
    # layout is not checked against a world of 1 (there is no job yet), and the same mesh is asked for
    # and flattened the same way.
    ours, theirs = _build(__import__("hasten.utils", fromlist=["x"]), layout, monkeypatch), _build(
        accelerate, layout, monkeypatch)
    assert ours[:5] == theirs[:5]
    assert ours[4] == [(names, joint) for names, joint in
                       ((ours[5].dp_dim_names, "dp"), (ours[5].dp_shard_cp_dim_names, "dp_shard_cp"),
                        (ours[5].dp_cp_dim_names, "dp_cp")) if names]


def test_mesh_of_one_process_is_none_and_get_mesh_empty() -> None:
    assert ParallelismConfig()._get_mesh() == ()
    assert ParallelismConfig().build_device_mesh("cpu") is None  # cpu-on-purpose: nothing to lay out


def test_a_launched_job_of_the_wrong_size_is_refused_before_torch_builds_a_mesh(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # what the launcher says torch's rendezvous will have
    with mock.patch("torch.distributed.device_mesh.init_device_mesh", side_effect=RecordingMesh) as init:
        with pytest.raises(ValueError, match="tp_size=4 = 4 processes, but this job runs 2"):
            ParallelismConfig(tp_size=4).build_device_mesh("cpu")  # cpu-on-purpose: refused before any mesh
    assert init.call_count == 0


def test_a_lone_process_names_the_layout_when_torch_cannot_make_the_group(monkeypatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"tp_size=2 = 2 processes, but this process runs alone.*--num_processes 2"):
        ParallelismConfig(tp_size=2).build_device_mesh("cpu")  # cpu-on-purpose: this process runs alone


@pytest.mark.parametrize("value", ["invalid", "unsupported"])
def test_cp_comm_strategy_refusal_has_accelerates_words(value, monkeypatch) -> None:
    from hasten.utils import TorchContextParallelConfig

    with pytest.raises(ValueError, match=f"^Invalid cp_comm_strategy: {value} .*use one of"):
        TorchContextParallelConfig(cp_comm_strategy=value)
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", value)
    with pytest.raises(ValueError, match=f"^Invalid cp_comm_strategy: {value} "):
        ParallelismConfig(cp_size=2)


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_set_is_overflow_is_the_skip_flag_the_scheduler_follows(with_optimizer, fresh_state) -> None:
    import torch

    from hasten import Accelerator

    accelerator = Accelerator(step_scheduler_with_optimizer=with_optimizer)
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    optimizer._is_overflow = False  # Accelerate's private flag, as its scheduler tests set it
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.9) and optimizer.step_was_skipped is False
    optimizer._is_overflow = True  # a faked fp16 overflow: the scheduler does not advance with the optimizer
    scheduler.step()
    assert optimizer.step_was_skipped is True and optimizer._is_overflow is True
    assert scheduler.get_last_lr()[0] == pytest.approx(0.9 if with_optimizer else 0.8)
    optimizer._is_overflow = True
    optimizer.step()  # a real step sets the flag again
    assert optimizer._is_overflow is False


def test_to_fsdp2_on_an_fsdp2_config_logs_accelerates_record_and_prints_once(tmp_path, caplog) -> None:
    import os
    import subprocess
    import sys

    import yaml

    from hasten.commands.cli import main

    source = tmp_path / "fsdp2.yaml"
    source.write_text(yaml.safe_dump({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}))
    with caplog.at_level("WARNING"):
        assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(tmp_path / "a.yaml")]) == 0
    [record] = caplog.records
    assert record.name == "hasten.commands.to_fsdp2" and record.levelname == "WARNING"
    assert record.getMessage().startswith("Config already specifies FSDP2, skipping conversion...")
    # Without logging configured (the command line), the note is one stderr line, not two.
    code = ("import sys; from hasten.commands.cli import main; "
            f"sys.exit(main(['to-fsdp2', '--config_file', {str(source)!r}, '--output_file', {str(tmp_path / 'b.yaml')!r}]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stderr.splitlines() if "FSDP2" in line] == [
        "hasten to-fsdp2: Config already specifies FSDP2, skipping conversion... (fsdp_version: 2): it is written "
        "unchanged (set fsdp_version: 1 to convert FSDP1 key names)"]


def test_non_strict_load_with_extra_keys_is_a_log_record_not_a_warning(tmp_path, caplog) -> None:
    import warnings

    import torch

    from hasten.utils import load_checkpoint_in_model

    model = torch.nn.Linear(3, 2)
    state = dict(model.state_dict(), foo=torch.rand(4, 5))
    torch.save(state, tmp_path / "model.pt")
    for device_map in (None, {"": "cpu"}):  # cpu-on-purpose: the device map of Accelerate's test
        caplog.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # -W error: Accelerate only logs here, so hasten must not warn
            with caplog.at_level("WARNING"):
                load_checkpoint_in_model(torch.nn.Linear(3, 2), str(tmp_path / "model.pt"), device_map=device_map)
        [record] = caplog.records
        assert record.name == "hasten.utils.modeling" and "were not used when initializing Linear: ['foo']" in \
            record.getMessage()
        with pytest.raises((ValueError, RuntimeError)):
            load_checkpoint_in_model(torch.nn.Linear(3, 2), str(tmp_path / "model.pt"), device_map=device_map,
                                     strict=True)


def test_recursively_apply_and_tensorboard_messages_have_accelerates_words(tmp_path, fresh_state) -> None:
    import torch

    from hasten import Accelerator
    from hasten.utils import recursively_apply

    with pytest.raises(TypeError) as refused:
        recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
    assert str(refused.value) == ("Unsupported types (<class 'int'>) passed to `tensor`. Only nested list/tuple/dicts "
                                  "of objects that are valid for `is_torch_tensor` should be passed.")
    pytest.importorskip("tensorboard")
    with pytest.raises(ValueError, match="^Logging with `tensorboard` requires a `logging_dir`.*project_dir="):
        Accelerator(log_with="tensorboard")


def test_estimate_memory_of_a_hub_name_is_an_os_error_without_the_network(monkeypatch) -> None:
    from hasten.commands import estimate

    monkeypatch.setattr(estimate, "verify_on_hub", lambda *a, **k: "gated")  # as Accelerate's test_gated does
    args = estimate.estimate_command_parser().parse_args(["meta-llama/Llama-2-7b-hf"])
    with pytest.raises(OSError, match="never downloads"):
        estimate.estimate_command(args)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="huggingface-cli download meta-llama/Llama-2-7b-hf config.json"):
        estimate.verify_on_hub("meta-llama/Llama-2-7b-hf")


# -- differences kept on purpose (docs/migration.md says why) ----------------------------------------------
def test_an_fsdp_config_on_a_machine_without_gpus_is_refused_not_run_on_cpu(tmp_path, capsys, monkeypatch) -> None:
    # Accelerate runs such a config on the CPU without a word; hasten stops before anything starts, so a job
    # meant for GPUs never trains on the CPU unnoticed (a missing driver, a wrong machine), and says how to
    # ask for the CPU.
    import yaml

    from hasten.commands.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = tmp_path / "fsdp.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                                      "num_processes": 1, "num_machines": 1, "use_cpu": False,
                                      "fsdp_config": {"fsdp_version": 2}}))
    (tmp_path / "train.py").write_text("")
    assert main(["launch", "--config_file", str(config), str(tmp_path / "train.py")]) == 2
    err = capsys.readouterr().err
    assert "distributed_type FSDP asks for GPUs but this machine shows none" in err and "add --cpu" in err
    assert main(["launch", "--config_file", str(config), "--cpu", "--dry_run", str(tmp_path / "train.py")]) == 0
