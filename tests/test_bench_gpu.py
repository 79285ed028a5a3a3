"""bench/gpu.py in its smoke mode: a tiny Llama on this machine's device, one round, every framework
installed, each in its own process; the table has a row per framework with figures in every column."""

import importlib.util
import os
import re
import subprocess
import sys


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu.py")


def _run(*args):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=600)


def test_smoke_run_prints_one_row_per_framework_with_ratio_memory_and_checkpoint_times():
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    proc = _run("--small", "--device", device, "--steps", "2", "--warmup", "1", "--rounds", "1", "--variants", "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| bf16 \| (\w+) \|.*$", proc.stdout, re.M)}
    expected = ["raw", "hasten"] + (["accelerate"] if importlib.util.find_spec("accelerate") else [])
    assert sorted(rows) == sorted(expected), proc.stdout
    assert "failed" not in proc.stdout, proc.stdout
    cells = {name: [c.strip() for c in row.strip("|").split("|")] for name, row in rows.items()}
    assert cells["raw"][3] == "1.000"  # the reference of the ratio column
    for name, row in cells.items():
        assert float(row[2]) > 0 and float(row[5]) > 0 and float(row[7]) > 0, row  # ms/step, save, load
        assert (row[4] != "—") == (device == "cuda"), row  # peak CUDA memory only on a GPU
    first, later = (float(x) for x in cells["hasten"][6].split("/"))  # background save: until it returns
    assert first > 0 and later > 0
    assert re.search(r"parameters: 0\.00\d B", proc.stdout)


def test_unknown_variant_names_the_choices():
    proc = _run("--small", "--device", "cpu", "--variants", "bf17")
    assert proc.returncode != 0
    assert "unknown framework or variant 'bf17'" in proc.stderr and "bf16+compile" in proc.stderr


def test_fp8_and_accelerate_are_skipped_with_a_message_when_not_installed(monkeypatch):
    import argparse

    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    found = importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec",
                        lambda name: None if name in ("torchao", "accelerate") else found(name))
    args = argparse.Namespace(frameworks="raw,hasten,accelerate", variants="bf16,fp8,fp8+compile", small=True,
                              device="cpu", steps=1, warmup=1, no_checkpoint=True, dir=None)
    jobs, notes = bench.plan(args)
    assert [(j["framework"], j["variant"]) for j in jobs] == [("raw", "bf16"), ("hasten", "bf16")]
    assert any("torchao is not installed: the fp8 variants are skipped" in n for n in notes)
    assert any("Accelerate is not installed" in n for n in notes)
