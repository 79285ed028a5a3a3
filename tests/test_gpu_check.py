"""bench/gpu_check.py, the GPU check for a short loan, on any machine: it lists its checks, skips each
one with a reason where there is no GPU, exits 0 then, and every check's code path runs on CPU
(``--cpu-dry-run``: the flight-recorder reading, the memory accounting, saves and reloads, fp16,
compile, fp8), so that its first run on a GPU does not stop at a typo. A check that hangs is cut at
its budget and the next one still runs."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
LINE = re.compile(r"^(PASS|FAIL|ERROR|SKIP) +(\w+) \([\d.]+ s\): (.*)$", re.M)


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


def _runner():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(stdout: str) -> dict:
    return {name: (status, detail) for status, name, detail in LINE.findall(stdout)}


def test_list_names_every_check_in_order_with_a_budget():
    cases = _runner().cases
    proc = _run("--list", timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == list(cases.CHECKS) and names[0] == "imports" and names[-1] == "bench_gpu"
    assert sum(c.budget_s for c in cases.CHECKS.values()) > 480  # the global deadline, not the sum, bounds a run


def test_without_a_gpu_every_check_is_skipped_with_the_reason_and_the_exit_status_is_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the checks would run")
    proc = _run(timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(proc.stdout)
    assert list(results) == list(_runner().cases.CHECKS)
    assert {status for status, _ in results.values()} == {"SKIP"}
    assert all("no CUDA device" in detail for _, detail in results.values())
    assert "0 passed, 0 failed, 12 skipped" in proc.stdout


def test_cpu_dry_run_runs_every_check_body_without_a_failure():
    """Each check's code on CPU, one after another in one process (the budgets are for a GPU)."""
    proc = _run("--cpu-dry-run", "--in-process", timeout=400)
    results = _results(proc.stdout)
    assert list(results) == list(_runner().cases.CHECKS), proc.stdout + proc.stderr[-2000:]
    broken = {n: r for n, r in results.items() if r[0] in ("FAIL", "ERROR")}
    assert not broken and proc.returncode == 0, broken or proc.stderr[-2000:]
    # the GPU-only ones say so; the flight recorder was read back through the hang reporter's reader
    assert results["suite_cuda_tests"][0] == results["bench_gpu"][0] == "SKIP"
    assert "all_reduce(float[1024])" in results["flight_recorder"][1]
    assert "peak after prepare 0 MiB" in results["fsdp2_offload_memory"][1]


def test_each_check_runs_in_its_own_process_and_one_that_overruns_its_budget_is_cut():
    runner = _runner()
    facts = runner.machine_facts()
    cut = runner.run_in_subprocess("imports", dry_run=True, budget=0.5)  # importing torch takes longer
    assert cut["status"] == "ERROR" and "no result within its 0 s budget" in cut["detail"], cut
    assert runner.cases.CHECKS["fp8"].missing(dict(facts, torchao=False), dry_run=True).startswith(
        "torchao is not installed")
    gpu = dict(facts, torch="2.11", cuda=True, capability=[8, 0])
    assert "compute capability 8.9" in runner.cases.CHECKS["fp8"].missing(gpu, dry_run=False)
    assert runner.cases.CHECKS["suite_cuda_tests"].missing(dict(gpu, pytest=True), dry_run=False) is None
    done = runner.run_in_subprocess("flight_recorder", dry_run=True, budget=120)  # its result read back from the child
    assert done["status"] == "PASS" and "all_reduce" in done["detail"], done


def test_an_unknown_check_name_is_one_clear_error():
    proc = _run("--only", "imports,fp9", timeout=60)
    assert proc.returncode == 2 and "unknown check(s) fp9" in proc.stderr and "flight_recorder" in proc.stderr
