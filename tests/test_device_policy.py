"""The suite's device policy (tests/devices.py) and a guard that keeps the tests device-agnostic.

This machine may have no GPU, so the guard reads the test sources for the habits that broke the
suite on a GPU machine: asserting that a device is the CPU, references forced onto the CPU (autocast,
device meshes), ``Accelerator(cpu=True)`` inside a check module (a no-op there: the harness already
chose the rank's device) and ``fully_shard`` without an explicit mesh (its default mesh is CUDA
whenever a GPU exists, even for ranks told to use the CPU). A line that means the CPU on purpose says
so with ``cpu-on-purpose`` (on the line or the one above).
"""

import os
import re

import pytest

from devices import launch_flags, process_env, ranks_get_own_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
MARKER = "cpu-on-purpose"

# (what is wrong, pattern, which files: "all" or "checks" (the modules the 2-rank harness runs))
RULES = [
    ("asserts a CPU device; compare with acc.device / devices.expected_device",
     re.compile(r"\bassert\b.*device(\.type)?\s*==\s*(torch\.device\()?[\"']cpu"), "all"),
    ("autocast forced to CPU; use the tensors' device type", re.compile(r"autocast\(\s*[\"']cpu"), "all"),
    ("device mesh forced to CPU; build it on the rank's device", re.compile(r"init_device_mesh\(\s*[\"']cpu"), "all"),
    ("Accelerator(cpu=True) in a check module does nothing (the harness chose the device); drop cpu=True",
     re.compile(r"Accelerator\(\s*cpu\s*=\s*True"), "checks"),
    ("fully_shard without mesh=: its default mesh is CUDA whenever a GPU exists",
     re.compile(r"\bfully_shard\((?![^#]*\bmesh=)"), "checks"),
]


def violations(path: str, text: str) -> list[str]:
    """Every line of ``text`` (the source of ``path``) that breaks a rule, as 'file:line: why'."""
    name = os.path.basename(path)
    in_checks = name.startswith("checks_") or name == "fp8_common.py"
    found, previous = [], ""
    for number, line in enumerate(text.splitlines(), start=1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if MARKER not in line and MARKER not in previous:
            for why, pattern, scope in RULES:
                if (scope == "all" or in_checks) and pattern.search(code):
                    found.append(f"{name}:{number}: {why}: {line.strip()}")
        previous = line
    return found


def _sources():
    for folder in (HERE, os.path.join(HERE, "scripts")):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and name != os.path.basename(__file__):
                yield os.path.join(folder, name)


def test_the_suite_has_no_cpu_only_habits():
    found = []
    for path in _sources():
        with open(path) as f:
            found += violations(path, f.read())
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("line, rule", [
    ('    assert acc.device == torch.device("cpu")', 0),
    ('    assert s.device.type == "cpu", s', 0),
    ('    with torch.autocast("cpu", dtype=torch.bfloat16):', 1),
    ('    mesh = init_device_mesh("cpu", (2,))', 2),
    ("    acc = Accelerator(cpu=True, mixed_precision='fp16')", 3),
    ("        fully_shard(block)", 4),
])
def test_the_guard_flags_each_habit(line, rule):
    found = violations("checks_example.py", "import torch\n" + line + "\n")
    assert len(found) == 1 and RULES[rule][0] in found[0], found
    # ... and a line that says it means the CPU passes
    assert violations("checks_example.py", f"# {MARKER}: why\n{line}\n") == []


def test_the_guard_leaves_device_agnostic_lines_alone():
    text = "\n".join([
        "    assert acc.device == expected_device(s.local_process_index)",
        "    with torch.autocast(x.device.type, dtype=torch.bfloat16):",
        "    fully_shard(model, mesh=init_device_mesh(device.type, (2,)),",
        "    acc = Accelerator(cpu=True)  # an in-process test: cpu=True really chooses the CPU",
        "    if acc.device.type == 'cpu':  # a branch, not an assertion",
    ])
    assert violations("test_example.py", text) == []


@pytest.mark.parametrize("processes, gpus, env, flags", [
    (1, 0, {"HASTEN_USE_CPU": "1"}, ["--cpu"]),
    (1, 1, {}, []),  # one process runs on the GPU
    (2, 1, {"HASTEN_USE_CPU": "1"}, ["--cpu"]),  # two ranks cannot share one GPU: CPU and gloo
    (2, 2, {}, []),  # a GPU each: NCCL
    (4, 2, {"HASTEN_USE_CPU": "1"}, ["--cpu"]),
])
def test_policy_gives_each_rank_a_gpu_or_none(processes, gpus, env, flags):
    assert ranks_get_own_gpu(processes, gpus) == (env == {})
    assert process_env(processes, gpus) == env
    assert launch_flags(processes, gpus) == flags


def test_suite_run_under_hasten_use_cpu_stays_on_cpu(monkeypatch):
    """`HASTEN_USE_CPU=1 pytest` on a GPU machine: every launch of the suite asks for the CPU too."""
    monkeypatch.setenv("HASTEN_USE_CPU", "1")
    assert not ranks_get_own_gpu(1) and process_env(2) == {"HASTEN_USE_CPU": "1"} and launch_flags(1) == ["--cpu"]


def test_reference_device_is_where_a_new_accelerator_puts_its_tensors(fresh_state):
    from devices import reference_device

    from hasten import Accelerator

    predicted = reference_device()  # no process state yet: what a new one-process Accelerator will pick
    assert Accelerator().device == predicted == reference_device()
