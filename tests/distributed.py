"""Run check functions in real processes (1, 2 or 4 ranks) and report per rank.

One launch runs every ``check_*`` function of a module in the same processes, so the ~2 s
start-up of each process is paid once per module, not once per test. Each rank writes one JSON
line per check as it finishes; a test then judges what each rank *reported*, so a rank that
aborts during teardown (a known gloo quirk) cannot make a passing check fail.

Devices follow tests/devices.py: the ranks use one GPU each (NCCL) when the machine has enough,
else CPU (gloo) through ``HASTEN_USE_CPU=1``, the variable ``hasten launch --cpu`` sets.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Optional

from devices import process_env

HERE = os.path.dirname(os.path.abspath(__file__))


def reset_state() -> None:
    """Forget the process state and the gradient state, as a new process starts."""
    from hasten.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def one_process_checkpoint(folder: str, model, features: int) -> tuple[str, dict]:
    """Train ``model`` one AdamW step in this process and ``save_state`` it to ``folder``, for
    tests that load a one-process checkpoint into a multi-process layout. Returns the folder and
    the saved weights (as lists)."""
    import torch

    from hasten import Accelerator

    reset_state()
    acc = Accelerator()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, features, device=acc.device)).pow(2).mean())
    opt.step()
    acc.save_state(folder)
    expected = {k: v.tolist() for k, v in model.state_dict().items()}
    reset_state()
    return folder, expected


def evil_pickle(marker: str) -> bytes:
    """A pickle that creates the file ``marker`` when it is loaded: what a tampered checkpoint file can do."""
    import pickle

    class Opens:
        def __reduce__(self):
            return open, (marker, "w")

    return pickle.dumps(Opens(), protocol=4)  # refers to the global io.open


def tamper(folder: str, name: str, data: bytes) -> None:
    """Replace the file ``name`` of the checkpoint ``folder`` with ``data`` and record its new size in the
    manifest, as somebody who edits a checkpoint would (a size check alone would notice otherwise)."""
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    from hasten.checkpointing import layout
    from hasten.files import reading as filereading

    manifest["files"][name].update(size=len(data), checksum=filereading.file_checksum(os.path.join(folder, name)))

    manifest[layout.CHECKSUM_KEY] = layout.manifest_checksum(manifest)  # and the manifest's own checksum
    with open(path, "w") as f:
        json.dump(manifest, f)


def refused_load(acc, folder: str, marker: str) -> str:
    """``acc.load_state(folder)`` of a checkpoint tampered with ``evil_pickle(marker)``: checks, once every
    process tried, that it raised ``pickle.UnpicklingError`` and that nothing in the file ran; its message."""
    import pickle

    try:
        acc.load_state(folder)
    except Exception as e:  # noqa: BLE001 - the kind and message are judged below
        refused = e
    else:
        raise AssertionError(f"the tampered checkpoint {folder!r} loaded")
    acc.wait_for_everyone()
    assert not os.path.exists(marker), f"the tampered file ran code ({type(refused).__name__}: {refused})"
    assert isinstance(refused, pickle.UnpicklingError), f"{type(refused).__name__}: {refused}"
    return str(refused)


def mesh_facts(acc) -> dict:
    """What ``acc.torch_device_mesh`` and the rank properties say about this process (for mesh checks)."""
    mesh = acc.torch_device_mesh
    flat = {}
    for name in ("dp", "dp_shard_cp", "dp_cp"):
        try:
            flat[name] = [mesh[name].size(), mesh[name].get_local_rank()]
        except (KeyError, ValueError, RuntimeError):  # not built: no enabled part
            flat[name] = None
    return {"names": list(mesh.mesh_dim_names), "shape": list(mesh.shape), "flat": flat,
            "ranks": {"dp_replicate": acc.data_parallel_rank, "dp_shard": acc.data_parallel_shard_rank,
                      "tp": acc.tensor_parallel_rank, "cp": acc.context_parallel_rank},
            "local": {n: mesh.get_local_rank(n) for n in mesh.mesh_dim_names}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    return [n for n in vars(module) if n.startswith("check_") and callable(getattr(module, n))]


class Report:
    def __init__(self, world_size: int, results: list[dict], logs: list[str]):
        self.world_size = world_size
        self.results = results  # per rank: name -> {"ok", "error", "value"}
        self.logs = logs

    def assert_passed(self, name: str) -> list:
        values = []
        for rank in range(self.world_size):
            res = self.results[rank].get(name)
            if res is None:
                raise AssertionError(f"rank {rank} never reported {name}; its log:\n{self.logs[rank][-4000:]}")
            if not res["ok"]:
                raise AssertionError(f"{name} failed on rank {rank}:\n{res['error']}")
            values.append(res.get("value"))
        return values


def run_checks(module_name: str, world_size: int = 2, env: Optional[dict] = None, timeout: float = 900,
               only: Optional[list[str]] = None) -> Report:
    """Start ``world_size`` processes (torchrun's variables) that run the module's checks.

    ``env`` is applied last, so a test may still pin a device policy of its own."""
    out = tempfile.mkdtemp(prefix="hasten-checks-")
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        penv = dict(os.environ)
        penv.update(process_env(world_size))
        penv.update(env or {})
        penv.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HASTEN_TEST_TMP=out, OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([HERE, penv.get("PYTHONPATH", "")]),
        )
        if world_size == 1:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                penv.pop(key)
        log = open(os.path.join(out, f"log{rank}.txt"), "w")
        cmd = [sys.executable, os.path.join(HERE, "distributed.py"), module_name, out, str(rank)]
        if only:
            cmd += only
        procs.append(subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT, cwd=HERE))
        logs.append(log)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    for log in logs:
        log.close()
    results, texts = [], []
    for rank in range(world_size):
        path = os.path.join(out, f"rank{rank}.jsonl")
        res = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    item = json.loads(line)
                    res[item["name"]] = item
        results.append(res)
        with open(os.path.join(out, f"log{rank}.txt")) as f:
            texts.append(f.read())
    return Report(world_size, results, texts)


def _barrier(dist) -> None:
    """A barrier between checks; NCCL is told this rank's GPU (else it guesses one, with a warning)."""
    if dist.get_backend() == "nccl":
        import torch

        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _worker(module_name: str, out: str, rank: int, only: list[str]) -> None:
    import torch.distributed as dist

    from hasten.state import AcceleratorState, GradientState, PartialState

    state = PartialState(timeout=timedelta(seconds=120))
    module = importlib.import_module(module_name)
    names = only or check_names(module_name)
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        for name in names:
            AcceleratorState._reset_state()
            GradientState._reset_state()
            try:
                value = getattr(module, name)()
                item = {"name": name, "ok": True, "value": value}
            except BaseException:  # noqa: BLE001 - report everything, keep going
                item = {"name": name, "ok": False, "error": traceback.format_exc()}
            try:
                json.dumps(item)
            except TypeError:
                item["value"] = repr(item.get("value"))
            f.write(json.dumps(item) + "\n")
            f.flush()
            if state.use_distributed and dist.is_initialized():
                _barrier(dist)
    state.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
