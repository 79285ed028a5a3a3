"""The examples users copy (examples/*.py) run as written, with `--tiny`, on 2 CPU processes."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _launch(script: str, *args: str, launch_flags: tuple = ("--cpu", "--num_processes", "2"), cwd=None) -> str:
    """Runs an example under `hasten launch`; returns its output, failing the test with it on a non-zero exit."""
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", *launch_flags,
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


@pytest.mark.parametrize("device_map", ["auto", "cpu_disk"])
def test_big_model_inference_generates_what_the_whole_model_does(device_map):
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "big_model_inference.py"), "--tiny",
                          "--device_map", device_map], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok: the same logits and tokens" in out.stdout, out.stdout
    generated = re.search(r"generated: \[([\d, ]+)\]", out.stdout).group(1).split(", ")
    assert len(generated) == 8 and len(set(generated)) > 1, out.stdout  # real decoding, not one repeated token
    if device_map == "cpu_disk":
        assert "'model.layers.3': 'disk'" in out.stdout, out.stdout
