"""The bundled example trains through the launcher on 2 CPU processes and on 1."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train.py")


def _epochs(output: str) -> list[tuple[float, float, int, int]]:
    rows = re.findall(r"epoch \d+: train loss ([\d.]+)\s+eval accuracy ([\d.]+) \((\d+) samples, (\d+) process", output)
    return [(float(a), float(b), int(c), int(d)) for a, b, c, d in rows]


def test_example_two_processes_through_launcher():
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", "2",
                          EXAMPLE, "--epochs", "2"], capture_output=True, text=True, timeout=300)
    rows = _epochs(out.stdout)
    assert len(rows) == 2, out.stdout + out.stderr
    assert all(samples == 1000 and procs == 2 for _, _, samples, procs in rows)  # every eval sample exactly once
    assert rows[-1][1] > 0.95 and rows[-1][0] < rows[0][0], rows


def test_example_one_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, EXAMPLE, "--epochs", "1", "--mixed_precision", "bf16"],
                         capture_output=True, text=True, timeout=300, env=env)
    rows = _epochs(out.stdout)
    assert len(rows) == 1 and rows[0][2] == 1000 and rows[0][3] == 1, out.stdout + out.stderr
    assert rows[0][1] > 0.9, rows


def test_tracking_example_two_processes_with_tensorboard(tmp_path):
    """An Accelerate-style tracking script (log_with, init_trackers, log, end_training) under the launcher."""
    import tracker_readers as read

    example = os.path.join(ROOT, "examples", "tracking.py")
    out = subprocess.run([sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", "2",
                          example, "--with_tracking", "--log_with", "tensorboard", "--project_dir", str(tmp_path),
                          "--epochs", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    scalars = read.tensorboard_scalars(str(tmp_path / "tracking"))
    assert [step for step, _ in scalars["accuracy"]] == [0, 1] and scalars["accuracy"][-1][1] > 0.9, scalars
    assert scalars["train_loss"][1][1] < scalars["train_loss"][0][1]
    assert read.tensorboard_hparams(str(tmp_path / "tracking"))["batch_size"] == 32
