"""load_state on folders written by Accelerate's save_state (migration mid-training).

The checkpoints come from Accelerate itself (tests/scripts/accelerate_migration.py run with
``accelerate``); the same script resumed with Accelerate and with hasten must give the same numbers.
"""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from distributed import reset_state
from torch import nn

from hasten.saving import CheckpointMismatchError

pytest.importorskip("accelerate", reason="Accelerate writes the checkpoints these tests load (test extra)")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "accelerate_migration.py")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(HERE, "..", "src"), env.get("PYTHONPATH")) if p)
    return env


def _run(cmd: list, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def _script(lib: str, mode: str, folder, out, *extra: str, processes: int = 1) -> list:
    args = [SCRIPT, lib, mode, str(folder), str(out), *extra]
    if processes == 1:
        return [sys.executable, *args]
    if lib == "hasten":
        return [sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", str(processes),
                *args]
    port = str(29400 + random.randrange(500))
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
            port, *args]


def _result(out, rank: int = 0) -> dict:
    with open(f"{out}.{rank}.json") as f:
        return json.load(f)


def _same(a: dict, b: dict, keys=("weights", "lr", "step", "draws", "counter", "adam_steps")) -> None:
    for key in keys:
        if key == "weights":
            assert a[key].keys() == b[key].keys()
            for name in a[key]:
                torch.testing.assert_close(torch.tensor(a[key][name]), torch.tensor(b[key][name]),
                                           rtol=1e-6, atol=1e-7, msg=f"weight {name}")
        else:
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Accelerate checkpoints (one process) as safetensors and as pytorch_model.bin, and Accelerate's own resume."""
    root = tmp_path_factory.mktemp("accelerate")
    out = {}
    for variant in ("safetensors", "bin"):
        folder = root / variant
        extra = ("bin",) if variant == "bin" else ()
        _run(_script("accelerate", "save", folder, "-", *extra))
        _run(_script("accelerate", "resume", folder, root / f"{variant}_accelerate"))
        out[variant] = (folder, _result(root / f"{variant}_accelerate"))
    return out


@pytest.mark.parametrize("variant", ["safetensors", "bin"])
def test_resume_matches_accelerate(saved, tmp_path, variant):
    folder, reference = saved[variant]
    names = set(os.listdir(folder))
    assert ("model.safetensors" if variant == "safetensors" else "pytorch_model.bin") in names
    assert {"optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"} <= names
    _run(_script("hasten", "resume", folder, tmp_path / "hasten"))
    ours = _result(tmp_path / "hasten")
    _same(ours, reference)
    assert ours["adam_steps"] == [4.0] * 4 and ours["counter"][0] == 4  # 3 saved steps + the one after load


def _copy(folder, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


class _Opens:
    """Unpickling this creates ``path`` (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_tampered_rng_pickle_is_refused_before_it_runs(saved, tmp_path):
    """Issue 23: a tampered random_states file is an error naming it (it used to be skipped with a warning,
    leaving the generators as they were without a word), and nothing in it runs."""
    folder, _ = saved["safetensors"]
    folder = _copy(folder, tmp_path)
    marker = tmp_path / "pwned"
    state = torch.load(folder / "random_states_0.pkl", weights_only=False)
    state["random_state"] = _Opens(marker)
    torch.save(state, folder / "random_states_0.pkl")
    proc = _run(_script("hasten", "resume", folder, tmp_path / "hasten"), check=False)
    assert proc.returncode != 0 and not marker.exists()
    assert str(folder / "random_states_0.pkl") in proc.stderr and "tampered" in proc.stderr
    assert "open" in proc.stderr  # the refused global is named


def test_tampered_optimizer_file_is_refused_naming_it(saved, tmp_path):
    folder = _copy(saved["bin"][0], tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _Opens(marker)}, folder / "optimizer.bin")
    proc = _run(_script("hasten", "resume", folder, tmp_path / "hasten"), check=False)
    assert proc.returncode != 0 and not marker.exists()
    assert "optimizer.bin: refused by the weights-only unpickler" in proc.stderr
    assert "nothing was changed" in proc.stderr


def test_two_processes_under_hasten_launch(tmp_path):
    folder = tmp_path / "ckpt"
    _run(_script("accelerate", "save", folder, "-", processes=2))
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(folder))
    _run(_script("accelerate", "resume", folder, tmp_path / "acc", processes=2))
    _run(_script("hasten", "resume", folder, tmp_path / "ours", processes=2))
    for rank in (0, 1):
        _same(_result(tmp_path / "ours", rank), _result(tmp_path / "acc", rank))
    # each process took its own random states
    assert _result(tmp_path / "ours", 0)["draws"]["numpy"] != _result(tmp_path / "ours", 1)["draws"]["numpy"]


# -- in this process: checks before changes, ties, loader positions ---------------------------------------
def _accelerate_save(folder, model, scaler=None, **tensors):
    """Accelerate's own writer (what its save_state calls) for one model, plus hand-made extra files."""
    from accelerate.checkpointing import save_accelerator_state

    os.makedirs(folder, exist_ok=True)
    save_accelerator_state(str(folder), [model.state_dict()], [], [], [], 0, 0, scaler=scaler)
    for name, obj in tensors.items():
        torch.save(obj, os.path.join(folder, name))


class Tied(nn.Module):
    def __init__(self, out=10):
        super().__init__()
        self.embed = nn.Embedding(out, 4)
        self.head = nn.Linear(4, out, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_and_mismatch_checked_before_any_change(tmp_path, fresh_state):
    from hasten import Accelerator

    torch.manual_seed(1)
    source = Tied()
    _accelerate_save(tmp_path / "ok", source)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ok" / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 1  # Accelerate kept one name of the tied pair
    acc = Accelerator()
    model = acc.prepare(Tied())
    acc.load_state(str(tmp_path / "ok"))
    torch.testing.assert_close(model.head.weight, source.embed.weight, rtol=0, atol=0)
    assert model.head.weight is model.embed.weight

    reset_state()
    _accelerate_save(tmp_path / "wrong", Tied(out=12))
    acc = Accelerator()
    model = acc.prepare(Tied())
    before = model.embed.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"shapes differ .*checkpoint \[12, 4\], model \[10, 4\]"):
        acc.load_state(str(tmp_path / "wrong"))
    torch.testing.assert_close(model.embed.weight, before, rtol=0, atol=0)


def test_counts_must_match(tmp_path, fresh_state):
    from hasten import Accelerator

    model = nn.Linear(3, 2)
    _accelerate_save(tmp_path, model, **{"optimizer.bin": torch.optim.SGD(model.parameters(), 0.1).state_dict()})
    assert "random_states_0.pkl" in os.listdir(tmp_path)
    acc = Accelerator()
    acc.prepare(nn.Linear(3, 2))
    with pytest.raises(CheckpointMismatchError, match=r"1 optimizer states \(optimizer.bin\) but 0 are prepared"):
        acc.load_state(str(tmp_path))
    os.makedirs(tmp_path / "pytorch_model_fsdp_0")  # Accelerate's sharded FSDP layout
    with pytest.raises(CheckpointMismatchError, match="sharded FSDP or DeepSpeed checkpoint of Accelerate"):
        acc.load_state(str(tmp_path))


# What Accelerate's save_state writes for a stateful loader (torchdata 0.11) after 2 batches.
STATEFUL = {"_index_sampler_state": None, "_sampler_iter_state": None, "_sampler_iter_yielded": 2, "_num_yielded": 2,
            "_IterableDataset_len_called": None, "_shared_seed": None, "fetcher_state": None, "dataset_state": None,
            "_iterator_finished": False}


def test_loader_starts_a_fresh_pass_or_continues_a_stateful_position(tmp_path, fresh_state):
    """Accelerate without torchdata saves no position (its resume starts a new pass); with torchdata's
    stateful loaders it writes dl_state_dict.bin, whose batch count hasten continues from."""
    from hasten import Accelerator

    data = torch.arange(40.0).reshape(20, 2)
    model = nn.Linear(2, 1)
    _accelerate_save(tmp_path / "plain", model)
    acc = Accelerator()
    net, loader = acc.prepare(nn.Linear(2, 1), torch.utils.data.DataLoader(data, batch_size=4))
    acc.load_state(str(tmp_path / "plain"))
    torch.testing.assert_close(next(iter(loader)), data[:4].to(acc.device))

    _accelerate_save(tmp_path / "stateful", model, **{"dl_state_dict.bin": STATEFUL})
    for shuffle in (False, True):
        reset_state()
        acc = Accelerator()
        net, loader = acc.prepare(nn.Linear(2, 1), torch.utils.data.DataLoader(data, batch_size=4, shuffle=shuffle))
        if shuffle:
            with pytest.warns(UserWarning, match="continues after 2 batches .*shuffled order is hasten's"):
                acc.load_state(str(tmp_path / "stateful"))
            assert len(list(loader)) == 3  # the rest of the epoch: 5 batches minus the 2 consumed
        else:
            acc.load_state(str(tmp_path / "stateful"))
            torch.testing.assert_close(next(iter(loader)), data[8:12].to(acc.device))


STATEFUL_SCRIPT = """
import sys, torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
dl = acc.prepare(torch.utils.data.DataLoader(torch.arange(48.0).reshape(24, 2), batch_size=4))
it = iter(dl)
next(it), next(it)
acc.save_state(sys.argv[1])
acc.load_state(sys.argv[1])
print(next(iter(dl)).tolist())
"""


def test_mid_epoch_stateful_loader_continues_where_accelerate_does(tmp_path, fresh_state):
    pytest.importorskip("torchdata.stateful_dataloader", reason="Accelerate's stateful loaders need torchdata")
    from hasten import Accelerator

    proc = _run([sys.executable, "-c", STATEFUL_SCRIPT, str(tmp_path / "ckpt")])
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "dl_state_dict.bin" in os.listdir(tmp_path / "ckpt")
    acc = Accelerator()
    loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(48.0).reshape(24, 2), batch_size=4))
    acc.load_state(str(tmp_path / "ckpt"))
    assert next(iter(loader)).tolist() == theirs == torch.arange(16.0, 24.0).reshape(4, 2).tolist()


def test_fp16_scaler_state_is_restored(tmp_path, fresh_state):
    """Accelerate writes scaler.pt only with fp16 on a GPU; its content is GradScaler.state_dict()."""
    from hasten import Accelerator

    model = nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    _accelerate_save(tmp_path, model, scaler=scaler)
    assert "scaler.pt" in os.listdir(tmp_path)
    acc = Accelerator(mixed_precision="fp16")
    if acc.precision.scaler is None:
        pytest.skip("this device has no fp16 gradient scaler")
    acc.prepare(nn.Linear(2, 2))
    acc.load_state(str(tmp_path))
    assert acc.precision.scaler.get_scale() == 512.0
    assert acc.precision.scaler.state_dict()["growth_interval"] == 7
