"""Smoke test of hasten on the oldest torch that pyproject.toml declares (``make smoke-min``).

Not collected by pytest (the name does not start with ``test_``): it runs in the small venv that
``tools/min_torch_venv.sh`` builds, with ``PYTHONPATH=src``. What it covers is what an older torch
breaks first: the import, plain training with gradient clipping, ``save_state``/``load_state``
(also in the background), ``notebook_launcher`` (forked processes, an all_reduce), and, under
``hasten launch --cpu --num_processes 2`` (gloo), DDP and FSDP2 training steps with a sharded save and
reload. Exit status 0 when every part passed.

    python tests/smoke_min_torch.py            # everything (spawns the two launches itself)
    python tests/smoke_min_torch.py --rank-part ddp|fsdp   # one launched part (what the launch runs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

FEATURES = 8


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def _train(acc, model, opt, steps: int = 3, seed: int = 1) -> float:
    import torch

    g = torch.Generator().manual_seed(seed + acc.process_index)
    loss = None
    for _ in range(steps):
        x = torch.randn(4, FEATURES, generator=g).to(acc.device)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


def _weights(acc, model) -> dict:
    return {k: v.detach().clone().cpu() for k, v in acc.get_state_dict(model).items()}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def part_one_process(folder: str) -> None:
    """Plain training in this process: clip, save (blocking and background), train on, reload."""
    import torch

    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    _train(acc, model, opt)
    saved = _weights(acc, model)
    acc.save_state(os.path.join(folder, "blocking"))
    acc.save_state(os.path.join(folder, "background"), blocking=False)
    _train(acc, model, opt, seed=7)
    acc.wait_for_everyone()
    for name in ("blocking", "background"):
        acc.load_state(os.path.join(folder, name))
        assert _same(_weights(acc, model), saved), f"one process: {name} save did not reload bitwise"
    print("smoke: one process: train, clip, save_state (blocking and background), load_state: ok", flush=True)


def _all_reduce_ranks(folder: str) -> None:
    import torch
    import torch.distributed as dist

    from hasten.state import PartialState

    state = PartialState()
    total = torch.tensor([float(state.process_index + 1)], device=state.device)
    dist.all_reduce(total)
    with open(os.path.join(folder, f"rank{state.process_index}"), "w") as f:
        f.write(str(float(total)))


def part_notebook(folder: str) -> None:
    """``notebook_launcher`` forks 2 processes from this interpreter (torch's elastic agent underneath)."""
    from hasten import notebook_launcher

    os.makedirs(folder)
    notebook_launcher(_all_reduce_ranks, (folder,), num_processes=2, use_port="0")
    sums = sorted(open(os.path.join(folder, name)).read() for name in os.listdir(folder))
    assert sums == ["3.0", "3.0"], sums
    print("smoke: notebook_launcher, 2 forked processes, all_reduce: ok", flush=True)


def part_launched(kind: str, folder: str) -> None:
    """One rank of a 2-process launch: DDP or FSDP2 steps, sharded/replicated save, reload."""
    import torch

    from hasten import Accelerator
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if kind == "fsdp" else None
    acc = Accelerator(fsdp_plugin=plugin)
    assert acc.num_processes == 2, acc.num_processes
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    _train(acc, model, opt)
    saved = _weights(acc, model)
    acc.save_state(folder)
    _train(acc, model, opt, seed=5)
    acc.load_state(folder)
    assert _same(_weights(acc, model), saved), f"{kind}: reload differs on rank {acc.process_index}"
    acc.wait_for_everyone()
    if acc.is_main_process:
        print(f"smoke: {kind} on 2 processes: train, clip, save_state, load_state: ok", flush=True)
    acc.end_training()


def part_fullgraph() -> None:
    """A user-defined module prepared with bf16 and compiled by the user with ``fullgraph=True``:
    one graph, eager-autocast numbers (run in a process of its own: its own precision)."""
    import torch
    from torch import nn

    from hasten import Accelerator

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(FEATURES, 16), nn.Linear(16, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    torch.manual_seed(0)
    model = acc.prepare(Net())
    x = torch.randn(4, FEATURES)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert compiled.dtype == torch.float32 and torch.equal(compiled, eager), (compiled, eager)
    print("smoke: bf16-prepared module under torch.compile(fullgraph=True): ok", flush=True)


def _launch(kind: str, folder: str) -> None:
    command = [sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", "2",
               os.path.abspath(__file__), "--rank-part", kind, "--folder", folder]
    done = subprocess.run(command, timeout=300, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"smoke: {kind} launch failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    print(done.stdout.strip(), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-part", choices=("ddp", "fsdp"))
    parser.add_argument("--fullgraph", action="store_true", help="only the fullgraph compile check")
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.rank_part:
        part_launched(args.rank_part, args.folder)
        return 0
    if args.fullgraph:
        part_fullgraph()
        return 0
    start = time.perf_counter()
    import torch

    print(f"smoke: torch {torch.__version__} from {os.path.dirname(torch.__file__)}", flush=True)
    import hasten

    print(f"smoke: hasten {hasten.__version__} from {os.path.dirname(hasten.__file__)}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        part_notebook(os.path.join(folder, "notebook"))  # first: it forks, before this process has a group
        part_one_process(os.path.join(folder, "one"))
        for kind in ("ddp", "fsdp"):
            _launch(kind, os.path.join(folder, kind))
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--fullgraph"], timeout=300,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"smoke: fullgraph compile failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        print(done.stdout.strip(), flush=True)
    print(f"smoke: all passed on torch {torch.__version__} in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
