"""kill -9 during saves, 20 times: the newest complete checkpoint always loads and training resumes.

One parent process (torch imported once) forks a child per round. The child resumes with
``Accelerator(resume="auto")`` and then saves back to back (every save follows one optimizer step
and sets all weights to the step number, so each checkpoint's files must agree with its recorded
step). Once the child's first save of the round is complete, the parent SIGKILLs it at a random
moment (so every round makes progress, however loaded the machine), then checks on disk: the newest complete
checkpoint verifies (sizes, checksums) and is internally consistent, retention kept at most
``total_limit`` (+1 if the kill fell between commit and retention) complete checkpoints. The next
child must resume from exactly that checkpoint and continue its numbering. Writes a JSON report.

With MODE "background" the child saves with ``save_state(blocking=False)`` (each save waits for the
previous one), so most kills land while a background thread writes and training goes on.

With WRITES "direct" every file goes through the O_DIRECT path (by default only files of 16 MiB
and more do, and this model's are smaller).

Usage: python ckpt_killer.py OUT_JSON PROJECT_DIR [ROUNDS] [SEED] [MODE] [WRITES]
"""

import json
import os
import random
import signal
import sys
import time

import torch

torch.set_num_threads(1)

from hasten import Accelerator  # noqa: E402
from hasten.checkpointing import layout  # noqa: E402
from hasten.checkpointing.restorer import Reader  # noqa: E402
from hasten.state import AcceleratorState, GradientState  # noqa: E402
from hasten.utils import ProjectConfiguration  # noqa: E402
from ckpt_step import Step  # noqa: E402 - beside this script

TOTAL_LIMIT = 2
BLOCKING = (sys.argv[5] if len(sys.argv) > 5 else "blocking") != "background"
if (sys.argv[6] if len(sys.argv) > 6 else "buffered") == "direct":
    from hasten.files import safetensors_format as fileio

    fileio._DIRECT_MIN = 1


def child(project: str, pipe: int) -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True,
                                                          total_limit=TOTAL_LIMIT), resume="auto")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    step = Step()
    acc.register_for_checkpointing(step)  # resume="auto" restores it here
    resumed = step.value
    os.write(pipe, (json.dumps({"resumed": resumed, "iteration": acc.project_configuration.iteration}) + "\n").encode())
    x = torch.randn(4, 512, device=acc.device)
    while True:
        step.value += 1
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step.value))
        acc.save_state(blocking=BLOCKING)
        if step.value == resumed + 1:
            if not BLOCKING:
                acc.wait_for_checkpoint()
            os.write(pipe, b"saved\n")  # the parent starts its random delay now: every round makes progress


def verify(folder: str) -> int:
    """Check a complete checkpoint end to end; returns its recorded step."""
    manifest = layout.read_manifest(folder)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        reader = Reader(folder, manifest, pool)
        reader.verify(list(manifest["files"]))
        step, _ = reader.state(manifest["contents"]["custom_objects"][0]["file"])
        weights = reader.view("model.safetensors").tensors()
        assert all(bool((w == float(step["value"])).all()) for w in weights.values()), "weights != step"
        optimizer, _ = reader.state("optimizer.safetensors")
        assert len(optimizer["state"]) == 6
        reader.close()
    return int(step["value"])


def main() -> None:
    out, project = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    root = layout.auto_root(project)
    # Warm up what the children use (creating the first optimizer imports a lot), so that the forked
    # children start in milliseconds.
    warm = torch.nn.Linear(2, 2)
    torch.optim.Adam(warm.parameters()).step()
    report: dict = {"rounds": [], "errors": []}
    expected_resume = -1
    for round_ in range(rounds):
        newest_before = layout.newest_complete(root)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns
            os.close(read_fd)
            try:
                child(project, write_fd)
            finally:
                os._exit(1)
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            hello = json.loads(pipe.readline() or "null")
            pipe.readline()  # this round's first save is complete (a loaded machine may need seconds for it)
            delay = rng.uniform(0.02, 0.5)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        entry = {"delay": round(delay, 3), "hello": hello}
        if hello is None:
            report["errors"].append(f"round {round_}: the child died before resuming")
        elif hello["resumed"] != expected_resume:
            report["errors"].append(f"round {round_}: resumed at step {hello['resumed']}, expected {expected_resume}")
        elif newest_before is not None and hello["iteration"] != newest_before[0] + 1:
            report["errors"].append(f"round {round_}: numbering continues at {hello['iteration']}, "
                                    f"expected {newest_before[0] + 1}")
        names = sorted(os.listdir(root)) if os.path.isdir(root) else []
        entry["leftovers"] = [n for n in names if n.startswith(".")]
        complete = [n for n, p in layout.numbered(root) if layout.is_complete(p)]
        entry["complete"] = complete
        if len(complete) > TOTAL_LIMIT + 1:
            report["errors"].append(f"round {round_}: {len(complete)} complete checkpoints (limit {TOTAL_LIMIT})")
        newest = layout.newest_complete(root)
        if newest is not None:
            try:
                expected_resume = verify(newest[1])
                entry["newest"] = [newest[0], expected_resume]
            except Exception as e:  # noqa: BLE001
                report["errors"].append(f"round {round_}: newest complete checkpoint {newest[1]} fails: {e!r}")
        elif newest_before is not None:
            report["errors"].append(f"round {round_}: every complete checkpoint disappeared")
        report["rounds"].append(entry)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
