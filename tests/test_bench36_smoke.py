"""bench/moe_and_sequences.py runs end to end, tiny (``--quick``): 2 CPU processes under gloo, each
configuration one launch; it prints its command, two tables and the load (see docs/performance.md)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(text: str, title: str) -> dict[str, list[str]]:
    lines = text.split(title, 1)[1].splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| ") and not line.startswith("|---")]
    out = {}
    for row in rows[1:]:
        if row[0] in out:  # the next table
            break
        out[row[0]] = row
    return out


@pytest.mark.parametrize("part", ["moe", "seq"])
def test_moe_and_sequences_bench_quick(part):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "moe_and_sequences.py"), "--quick",
                           "--part", part], env=env, capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    text = done.stdout
    assert "command: python" in text and "load average at end" in text, text
    rows = _rows(text, "MoE:" if part == "moe" else "Long sequence:")
    names = ("ddp", "fsdp2", "ep2") if part == "moe" else ("one", "sp2", "cp2")
    assert list(rows) == list(names), rows
    held = {n: float(r[12]) for n, r in rows.items()}  # weights + AdamW state of the process, MB
    losses = {n: float(r[14]) for n, r in rows.items()}  # the same model, seed and first batch
    assert all(float(r[3]) > 0 for r in rows.values()), rows  # tokens/s
    if part == "moe":
        assert held["ep2"] < held["ddp"] and held["fsdp2"] < held["ddp"], held  # experts not replicated
        assert abs(losses["ep2"] - losses["ddp"]) < 1e-3 and losses["fsdp2"] == pytest.approx(losses["ddp"]), losses
    else:
        assert held["cp2"] < held["one"] and held["sp2"] == held["one"], held  # cp runs FSDP2, sp DDP
        assert all(abs(v - losses["one"]) < 1e-4 for v in losses.values()), losses
