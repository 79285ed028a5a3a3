"""The examples users copy (examples/*.py) run as written, with `--tiny`, on 2 processes."""

import os
import re
import subprocess
import sys

import pytest

from devices import launch_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _launch(script: str, *args: str, cwd=None) -> str:
    """Runs an example on 2 processes under `hasten launch` (GPUs where the machine has 2, else `--cpu`);
    returns its output, failing the test with it on a non-zero exit."""
    flags = [*launch_flags(2), "--num_processes", "2"]
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", *flags,
                          os.path.join(EXAMPLES, script), *args], capture_output=True, text=True, timeout=400, cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _epochs(output: str) -> dict[int, tuple[int, float, float]]:
    """epoch -> (step, train loss, eval accuracy) from the examples' `epoch N: step S train loss L ...` lines."""
    rows = re.findall(r"epoch (\d+): step (\d+) train loss ([\d.]+) eval accuracy ([\d.]+)", output)
    return {int(e): (int(s), float(loss), float(acc)) for e, s, loss, acc in rows}


def test_finetune_transformers_trains_saves_and_resumes_exactly(tmp_path):
    pytest.importorskip("transformers")
    flags = ["--tiny", "--output_dir", str(tmp_path), "--num_train_epochs", "2", "--learning_rate", "3e-3",
             "--gradient_accumulation_steps", "2", "--num_warmup_steps", "2"]
    full = _epochs(_launch("finetune_transformers.py", *flags))
    # 512 samples, 16 per process on 2 processes, 2 batches per optimizer step: 8 steps an epoch.
    assert [full[e][0] for e in (0, 1)] == [8, 16], full
    assert full[1][1] < full[0][1] and full[1][2] > 0.9, full
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).config.num_labels == 2
    # Resuming from the first epoch's checkpoint gives the uninterrupted run's second epoch, to the printed digit.
    resumed_out = _launch("finetune_transformers.py", *flags, "--resume_from_checkpoint", str(tmp_path / "epoch_0"))
    assert "epoch 1, step 8" in resumed_out, resumed_out
    assert _epochs(resumed_out) == {1: full[1]}, (resumed_out, full)


def test_big_model_inference_from_ram_and_disk_generates_what_the_whole_model_does():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "big_model_inference.py"), "--tiny",
                          "--device_map", "cpu_disk"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok: the same logits and tokens" in out.stdout, out.stdout
    generated = re.search(r"generated: \[([\d, ]+)\]", out.stdout).group(1).split(", ")
    assert len(generated) == 8 and len(set(generated)) > 1, out.stdout  # real decoding, not one repeated token
    assert "'model.layers.3': 'disk'" in out.stdout, out.stdout


def _counting_accuracy(folder) -> float:
    """Next-token accuracy of a saved causal LM on sequences that count upwards (what the examples teach)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = (torch.arange(0, 64, 5)[:, None] + torch.arange(16)) % model.config.vocab_size
    with torch.no_grad():
        predicted = model(input_ids=ids).logits[:, :-1].argmax(dim=-1)
    return (predicted == ids[:, 1:]).float().mean().item()


def test_fsdp2_trains_resumes_from_shards_and_saves_full_weights(tmp_path):
    pytest.importorskip("transformers")
    flags = ["--tiny", "--output_dir", str(tmp_path)]
    full = _epochs(_launch("fsdp2.py", *flags))
    assert [full[e][0] for e in (0, 1)] == [16, 32] and full[1][1] < full[0][1], full  # 256 / (8 x 2) a epoch
    # The gathered full weights (not a shard) were written: they reload alone and predict the sequences.
    assert _counting_accuracy(tmp_path / "final") > 0.9
    resumed_out = _launch("fsdp2.py", *flags, "--resume_from_checkpoint", str(tmp_path / "epoch_0"))
    assert "epoch 1, step 16" in resumed_out and _epochs(resumed_out) == {1: full[1]}, (resumed_out, full)


def test_deepspeed_zero3_trains_clips_checkpoints_and_saves(tmp_path, monkeypatch):
    """One launch, to keep the suite fast: ZeRO-3 resume is tested in tests/test_deepspeed.py (the
    example's resume path is the fine-tuning example's, run in the test above)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    monkeypatch.setenv("DS_BUILD_OPS", "0")
    out = _launch("deepspeed_zero.py", "--tiny", "--zero_stage", "3", "--output_dir", str(tmp_path))
    rows = re.findall(r"epoch (\d+): step (\d+) train loss ([\d.]+)", out)
    # 256 samples / (8 per batch x 2 processes x 2 accumulated) = 8 optimizer steps an epoch.
    assert [(e, s) for e, s, _ in rows] == [("0", "8"), ("1", "16")] and float(rows[1][2]) < float(rows[0][2]), out
    assert all((tmp_path / f"epoch_{e}").is_dir() for e in (0, 1))
    assert _counting_accuracy(tmp_path / "final") > 0.5  # consolidated weights reload with from_pretrained


def _slurm_env(node: int, port: int, shim_dir) -> dict:
    """What srun gives the task of node `node` in a 2-node job, plus what multinode.sbatch exports."""
    return {**os.environ, "PATH": f"{shim_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost",
            "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(port), "GPUS_PER_NODE": "1"}


def test_slurm_scripts_parse_plan_both_nodes_and_train_on_two_local_nodes(tmp_path):
    import socket

    slurm = os.path.join(EXAMPLES, "slurm")
    for script in ("multinode.sbatch", "launch_node.sh"):
        subprocess.run(["bash", "-n", os.path.join(slurm, script)], check=True)
    shim = tmp_path / "bin"  # `hasten` on PATH as an installed one would be, running this checkout
    shim.mkdir()
    (shim / "hasten").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hasten.commands.cli "$@"\n')
    (shim / "hasten").chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    train = os.path.join(EXAMPLES, "train.py")
    node_line = ["bash", os.path.join(slurm, "launch_node.sh"), train, "--epochs", "1"]
    for node in (0, 1):  # the exact line each node runs, checked without running anything
        env = {**_slurm_env(node, port, shim), "EXTRA_LAUNCH_ARGS": "--cpu --dry_run"}  # cpu-on-purpose
        plan = subprocess.run(node_line, env=env, capture_output=True, text=True, timeout=120)
        assert plan.returncode == 0, plan.stdout + plan.stderr
        assert f"starts 1 process(es) on machine {node} of 2" in plan.stdout, plan.stdout
        assert f"c10d rendezvous at 127.0.0.1:{port}" in plan.stdout, plan.stdout
    # Both "nodes" on this machine, one process each: one training run of 2 processes. On the CPU even
    # on a GPU machine, since each "node" would give its process the same first GPU.  # cpu-on-purpose
    envs = [{**_slurm_env(node, port, shim), "EXTRA_LAUNCH_ARGS": "--cpu"} for node in (0, 1)]  # cpu-on-purpose
    nodes = [subprocess.Popen(node_line, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for env in envs]
    outputs = [p.communicate(timeout=400)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs
    # accelerator.print prints once per machine: each node reports the same gathered evaluation.
    rows = [re.findall(r"eval accuracy ([\d.]+) \((\d+) samples, (\d+) process", out) for out in outputs]
    assert len(rows[0]) == 1 and rows[0] == rows[1], outputs
    assert rows[0][0][1:] == ("1000", "2") and float(rows[0][0][0]) > 0.9, outputs
