"""Recovery always works: restarts after a worker's death, and clean exits under torchrun.

- `hasten launch --cpu --num_processes 2 --max_restarts 1` with ``resume="auto"``: rank 1 dies after
  the checkpoint of step 4 (``os._exit`` or a raised error); the restarted workers resume from that
  checkpoint and finish. The config file says ``rdzv_backend: static``, as `hasten config default`
  writes it: static restarts shared the agent's store between rounds and the restarted workers read
  the dead workers' gloo addresses ("connectFullMesh ... Connection refused", or a hang).
- `torchrun --standalone --max-restarts 1` (c10d sharing its store with the workers): the same stale
  keys; hasten's process group reads the store through a prefix of the restart round.
- `torchrun --nproc_per_node 2 examples/train.py` (the README's command) exits 0.

A few runs by default; HASTEN_ATTACK_FULL=1 runs 20 restarts and 50 torchrun examples.
"""

import json
import os
import subprocess
import sys

import pytest
from scripts.launch_common import clean_env, free_port, hasten, script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FULL = bool(os.environ.get("HASTEN_ATTACK_FULL"))
RESTARTS = 20 if FULL else 2
EXAMPLES = 50 if FULL else 3
# (how the rank dies, which rank, blocking or background saves), taken in turn.
VARIANTS = [("exit", 1, "blocking"), ("raise", 1, "blocking"), ("exit", 0, "background"), ("raise", 0, "blocking")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "default_config.yaml"
    # What `hasten config default` writes on a CPU machine (rdzv_backend: static included).
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmachine_rank: 0\nnum_machines: 1\n"
                   "num_processes: 1\nrdzv_backend: static\nsame_network: true\nuse_cpu: true\n")
    return clean_env(cfg, OMP_NUM_THREADS=1)


def _resumed(out, how, run):
    seen = []
    for rank in range(2):
        path = os.path.join(out, f"rank{rank}.json")
        assert os.path.exists(path), f"run {run} ({how}): rank {rank} did not finish; files: {os.listdir(out)}"
        with open(path) as f:
            seen.append(json.load(f))
    return seen


@pytest.mark.parametrize("run", range(RESTARTS))
def test_launch_restart_resumes_from_the_checkpoint(tmp_path, env, run):
    how, rank, save = VARIANTS[run % len(VARIANTS)]
    out, project = tmp_path / "out", tmp_path / "project"
    out.mkdir()
    rc, stdout, err, _ = hasten(["launch", "--cpu", "--num_processes", "2", "--max_restarts", "1",
                                 script("attack_restart.py"), out, project, how, rank, save], env, timeout=300)
    variant = f"{how} rank {rank} {save}"
    assert rc == 0, f"run {run} ({variant}): exit status {rc}\n{err[-3000:]}"
    seen = _resumed(out, variant, run)
    assert [s["attempt"] for s in seen] == [1, 1], err[-3000:]
    assert [s["resumed_at"] for s in seen] == [4, 4] and [s["steps"] for s in seen] == [8, 8], seen
    for r in range(2):
        assert f"rank {r} attempt 1 resumed from step 4" in stdout, stdout


def _torchrun(args, env, cwd, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("run", range(1 if not FULL else 5))
def test_torchrun_restart_with_a_shared_store_resumes(tmp_path, env, run):
    out, project = tmp_path / "out", tmp_path / "project"
    out.mkdir()
    rc, stdout, err = _torchrun(["--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
                                 "--monitor-interval", "0.1", script("attack_restart.py"), out, project, "exit"],
                                dict(env, HASTEN_USE_CPU="1"), tmp_path)
    assert rc == 0, err[-3000:]
    seen = _resumed(out, "exit", run)
    assert [s["resumed_at"] for s in seen] == [4, 4] and [s["attempt"] for s in seen] == [1, 1], seen


@pytest.mark.parametrize("run", range(EXAMPLES))
def test_torchrun_example_exits_zero(tmp_path, env, run):
    """The README's `torchrun --nproc_per_node 2 examples/train.py` on CPU: every run exits 0."""
    # A port of its own instead of torchrun's fixed 29500, which another job on the machine may hold.
    rc, stdout, err = _torchrun(["--nproc_per_node", "2", "--master_port", free_port(),
                                 os.path.join(ROOT, "examples", "train.py")],
                                dict(env, HASTEN_USE_CPU="1"), tmp_path)
    assert rc == 0, f"run {run}: exit status {rc}\n{err[-3000:]}"
    assert stdout.count("epoch ") == 3 and "epoch 2:" in stdout, stdout
