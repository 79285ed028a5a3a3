"""`hasten test` with the configs that `hasten config` writes: the questionnaire is answered on
stdin (as a user would), then `hasten test --config_file` runs the sanity checks on real processes.

One case per questionnaire path that runs on this machine: one process or several on CPU, every
mixed precision, gradient accumulation on and off, torch.compile, and the FSDP and DeepSpeed
answers (offered for multi-GPU machines; run here with `--cpu`, two processes on gloo).
"""

import subprocess
import sys

import pytest
import yaml

from scripts.launch_common import clean_env, hasten

ONE = ["", "1", ""]  # this machine; no distributed training; CPU only (the default without a GPU)
CPUS = ["", "2", "", "2"]  # this machine; multi-CPU; 1 machine; 2 processes
GPUS = ["", "3", "", "2", ""]  # this machine; multi-GPU; 1 machine; 2 processes; all GPUs
NO_COMPILE = ["no"]
NO_SHARDING = ["no", "no"]  # no DeepSpeed, no FSDP (offered for CPU processes too)
FSDP = ["no", "yes", "", "", "no", "NO_WRAP", "", "", "no"]  # no DeepSpeed; FSDP 2, reshard, no offload, ...
ZERO2 = ["yes", "", "3", "", ""]  # DeepSpeed without a JSON file; stage 2 (3rd choice); no offload; clipping 1
ZERO3 = ["yes", "", "4", "", "", "", "", ""]  # stage 3; no offloads; zero3_init; save 16-bit; clipping 1

CASES = {
    # name: (answers, expected distributed_type, expected processes, extra `hasten test` flags)
    "one-process": (ONE + NO_COMPILE + ["", ""], "NO", 1, []),
    "one-process-accumulate-fp16": (ONE + NO_COMPILE + ["2", "fp16"], "NO", 1, []),
    "cpus-accumulate": (CPUS + NO_COMPILE + NO_SHARDING + ["2", "no"], "MULTI_CPU", 2, []),
    "cpus-accumulate-fp16": (CPUS + NO_COMPILE + NO_SHARDING + ["3", "fp16"], "MULTI_CPU", 2, []),
    "cpus-accumulate-bf16-compiled": (CPUS + ["yes", "aot_eager", "", "", ""] + NO_SHARDING + ["2", "bf16"], "MULTI_CPU", 2, []),
    "cpus-accumulate-fp8": (CPUS + NO_COMPILE + NO_SHARDING + ["2", "fp8", "", ""], "MULTI_CPU", 2, []),
    "fsdp-accumulate-bf16": (GPUS + NO_COMPILE + FSDP + ["2", "bf16"], "FSDP", 2, ["--cpu"]),
    "zero2-accumulate": (GPUS + NO_COMPILE + ZERO2 + ["2", "no"], "DEEPSPEED", 2, ["--cpu"]),
    "zero3-accumulate-bf16": (GPUS + NO_COMPILE + ZERO3 + ["2", "bf16"], "DEEPSPEED", 2, ["--cpu"]),
}


def questionnaire(path, env, answers):
    """`hasten config --config_file PATH` with the answers piped on stdin; the config it wrote."""
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "config", "--config_file", str(path)],
                          input="".join(f"{a}\n" for a in answers), env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_hasten_test_passes_with_each_questionnaire_answer(tmp_path, case):
    answers, kind, processes, flags = CASES[case]
    env = clean_env(tmp_path / "absent.yaml", CUDA_VISIBLE_DEVICES="")  # the questions' defaults as without GPUs
    cfg_path = tmp_path / "cfg.yaml"
    cfg = questionnaire(cfg_path, env, answers)
    assert (cfg["distributed_type"], cfg["num_processes"]) == (kind, processes), cfg
    accumulation = cfg.get("gradient_accumulation_steps") or cfg.get("deepspeed_config", {}).get(
        "gradient_accumulation_steps", 1)
    rc, out, err, _ = hasten(["test", "--config_file", cfg_path, *flags], env, timeout=300)
    assert rc == 0, out + err
    global_batch = 4 * processes * accumulation
    assert f"training step ok (matches one process on the global batch of {global_batch}" in out, out
    assert f"hasten test: success: every check passed on {processes} process(es)" in out, out
