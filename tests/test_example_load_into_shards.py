"""examples/load_into_shards.py under hasten launch on 2 CPU processes: the shards compute what the
plain model computes, and training goes on from there."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_load_into_shards_example_two_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", "2",
                          os.path.join(ROOT, "examples", "load_into_shards.py"), "--tiny", "--steps", "3"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "outputs equal the plain model's" in out.stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout
