"""The issue-25 benchmarks run end to end, tiny (``--quick``): each prints its command and one table.

bench/activation_checkpointing.py, bench/throughput_monitor.py and bench/several_models.py (2 CPU
processes under gloo, whatever the machine has: the benchmarks compare CPU jobs).
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", name), *args], env=env, capture_output=True,
                         text=True, timeout=420, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"command: python {os.path.join('bench', name)}" in out.stdout or "command: python" in out.stdout
    assert "load average at end" in out.stdout, out.stdout
    return out.stdout


def table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("|---")][1:]


def test_activation_checkpointing_bench_quick():
    pytest.importorskip("transformers")
    rows = table_rows(run_bench("activation_checkpointing.py", "--quick"))
    assert [r[0] for r in rows] == ["none", "full", "selective", "every_2", "full+offload"], rows
    kept = {r[0]: float(r[1].split()[0]) for r in rows}
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_throughput_monitor_bench_quick():
    rows = table_rows(run_bench("throughput_monitor.py", "--quick"))
    names = [r[1] for r in rows]
    assert names[:3] == ["plain", "hasten@1", "hasten@10"], names
    assert all(float(r[6]) > 0 for r in rows), rows
    assert all(float(r[3].split("/")[0]) > 0 for r in rows[1:]), rows  # time spent inside the monitor calls


def test_several_models_bench_quick():
    pytest.importorskip("accelerate")
    text = run_bench("several_models.py", "--quick", "--strategies", "fsdp2", "--jobs", "dpo")
    rows = table_rows(text)
    assert [(r[0], r[1], r[2]) for r in rows] == [("fsdp2", "dpo", w) for w in ("raw", "hasten", "accelerate")], rows
    hasten = rows[1]
    assert hasten[-1] == "yes", hasten  # hasten shards the frozen reference too
    assert "FIRST LOSSES DIFFER" not in text, text
