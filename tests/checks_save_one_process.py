"""``save_state`` called by process 0 only (``if accelerator.is_main_process:``, as diffusers' training
examples do) and by every process, inside each rank of 2 processes (tests/test_save_one_process.py).

Unsharded (DDP, a folder named by the caller): process 0 commits alone, the others attach their own
files. Sharded (FSDP2) or automatically named: a call made by process 0 alone is one clear error on
it within the arrival bound (the hang timeout here), never a hang.
"""

import json
import os
import random
import shutil
import time
import warnings

import numpy as np
import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils import InitProcessGroupKwargs, ProjectConfiguration


def _tmp(name):
    return os.path.join(os.environ["HASTEN_TEST_TMP"], name)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))


def _run(accum=1, hook=False, **kwargs):
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=accum, **kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Linear(16, 2))  # dropout: the RNG matters
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_data(), batch_size=4, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    if hook:
        acc.register_save_state_pre_hook(_drawing_hook)
    return acc, model, opt, loader


def _drawing_hook(models, weights, folder):
    """A save hook that draws random numbers (diffusers' hooks do, through what they call)."""
    torch.rand(3)
    random.random()
    np.random.rand(2)


def _file_hook(models, weights, folder):
    """A save hook that writes a file of its own on every process (into a subfolder, as save_pretrained)."""
    rank = int(os.environ["RANK"])
    os.makedirs(os.path.join(folder, "extra"), exist_ok=True)
    with open(os.path.join(folder, "extra", f"from_{rank}.txt"), "w") as f:
        f.write(f"process {rank}")


def _micro_step(acc, model, opt, batch):
    with acc.accumulate(model):
        x, y = batch
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def _weights(acc, model):
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def _draws():
    return [torch.rand(2).tolist(), random.random(), np.random.rand(2).tolist()]


def _manifest(folder):
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def check_ddp_main_only_save_then_load():
    """``if acc.is_main_process: acc.save_state(folder)`` on DDP: saved, loadable on 2 processes (process 1
    warned that it has no state of its own) and, by the test, on 1."""
    folder = _tmp("main_only")
    acc, model, opt, loader = _run(hook=True)
    batches = iter(loader)
    for _ in range(3):
        _micro_step(acc, model, opt, next(batches))
    start = time.monotonic()
    saved_to = acc.save_state(folder) if acc.is_main_process else None
    elapsed = time.monotonic() - start
    after_save = _draws()
    expected = _weights(acc, model)
    next_batch = next(batches)[0].tolist()
    acc.wait_for_everyone()
    names = sorted(os.listdir(folder))
    acc, model, opt, loader = _run(hook=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(folder, continue_dataloaders=True)
    resumed = _draws()
    got = _weights(acc, model)
    notes = [str(w.message) for w in caught if "holds no state of process" in str(w.message)]
    first = next(iter(loader))[0].tolist()
    return {"saved_to": saved_to, "elapsed": elapsed, "names": names,
            "weights": all(torch.equal(expected[k], got[k]) for k in expected),
            "rng_exact": resumed == after_save, "notes": notes, "same_batch": first == next_batch,
            "expected": {k: v.tolist() for k, v in expected.items()}, "folder": folder}


def _go_on(acc, model, opt, batches, steps=4):
    """``steps`` micro-steps: the first sample of each batch and the numbers drawn before each step."""
    seen, draws = [], []
    for _ in range(steps):
        batch = next(batches)
        seen.append(batch[0][0].tolist())
        draws.append(_draws())
        _micro_step(acc, model, opt, batch)
    return seen, draws


def _every_process(folder, blocking):
    """Save inside an accumulation window on every process (with a hook that draws random numbers), go on
    4 micro-steps; resume from the folder in fresh objects and take the same 4: the same draws and weights."""
    acc, model, opt, loader = _run(accum=2, hook=True)
    acc.register_save_state_pre_hook(_file_hook)
    batches = iter(loader)
    for _ in range(3):  # the third micro-step is the first of a window: partial gradients are saved
        _micro_step(acc, model, opt, next(batches))
    acc.save_state(folder, blocking=blocking)
    seen, draws = _go_on(acc, model, opt, batches)
    acc.wait_for_checkpoint()
    expected = _weights(acc, model)
    acc.wait_for_everyone()
    manifest = _manifest(folder)
    attached = sorted(n for n in os.listdir(folder) if n.startswith("attached_rank_"))
    with open(os.path.join(folder, "attached_rank_1.json")) as f:
        attachment = json.load(f)["files"]
    hook_files = {"manifest": sorted(n for n in manifest["files"] if n.startswith("extra/")),
                  "attachment": sorted(n for n in attachment if n.startswith("extra/")),
                  "on_disk": sorted(os.listdir(os.path.join(folder, "extra")))}
    hidden = sorted(n for n in os.listdir(os.path.dirname(folder)) if n.startswith(f".{os.path.basename(folder)}."))
    acc, model, opt, loader = _run(accum=2, hook=True)
    acc.load_state(folder, continue_dataloaders=True)
    reseen, redraws = _go_on(acc, model, opt, iter(loader))
    got = _weights(acc, model)
    worst = max(float((expected[k] - got[k]).abs().max()) for k in expected)
    return {"draws": redraws == draws, "batches": reseen == seen, "worst": worst,
            "listed": sorted(n for n in manifest["files"] if "rank" in n), "attached": attached,
            "hook_files": hook_files, "hidden": hidden}


def check_ddp_every_process_save_resumes_exactly():
    return _every_process(_tmp("every"), blocking=True)


def check_ddp_every_process_background_save_resumes_exactly():
    return _every_process(_tmp("every_bg"), blocking=False)


def check_attachment_damage_is_named():
    """Every-process save; then copies of it, each with one attack on process 1's own files: every process
    raises the same error, naming the file, and nothing changes."""
    good, other = _tmp("attached_good"), _tmp("attached_other")
    acc, model, opt, loader = _run(accum=2)
    batches = iter(loader)
    for _ in range(3):
        _micro_step(acc, model, opt, next(batches))
    acc.save_state(good)
    _micro_step(acc, model, opt, next(batches))
    acc.save_state(other)
    acc.wait_for_everyone()
    record = "attached_rank_1.json"

    def flip(folder, name, at=-20):
        path = os.path.join(folder, name)
        data = bytearray(open(path, "rb").read())
        data[at] ^= 0x01
        open(path, "wb").write(bytes(data))

    def truncate(folder, name):
        path = os.path.join(folder, name)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])

    def swap(folder, name):
        shutil.copy(os.path.join(other, name), os.path.join(folder, name))

    def link(folder, name):
        path = os.path.join(folder, name)
        os.replace(path, path + ".real")
        os.symlink(path + ".real", path)

    attacks = {
        "record_flip": lambda f: flip(f, record, at=40), "record_truncated": lambda f: truncate(f, record),
        "record_swapped": lambda f: swap(f, record), "record_link": lambda f: link(f, record),
        "rank_file_flip": lambda f: flip(f, "rank_1.safetensors"),
        "rank_file_truncated": lambda f: truncate(f, "rank_1.safetensors"),
        "rank_file_swapped": lambda f: swap(f, "rank_1.safetensors"),
        "grads_flip": lambda f: flip(f, "grads_rank_1.safetensors"),
        "rank_file_link": lambda f: link(f, "rank_1.safetensors"),
    }
    if acc.is_main_process:
        for label, attack in attacks.items():
            shutil.copytree(good, _tmp(label), symlinks=True)
            attack(_tmp(label))
    acc.wait_for_everyone()
    before = _weights(acc, model)
    seen = {}
    for label in attacks:
        try:
            acc.load_state(_tmp(label))
        except Exception as e:  # noqa: BLE001 - kind and message judged by the test
            seen[label] = f"{type(e).__name__}: {e}"
        else:
            seen[label] = "loaded"
        acc.wait_for_everyone()
    untouched = all(torch.equal(before[k], v) for k, v in _weights(acc, model).items())
    acc.load_state(good)  # the intact folder still loads
    return {"seen": seen, "untouched": untouched}


def _main_only_refused(acc, folder=None):
    """Process 0 saves alone; process 1 waits at a barrier. Returns process 0's error and how long it took."""
    outcome = None
    if acc.is_main_process:
        start = time.monotonic()
        try:
            acc.save_state(folder)
            outcome = {"error": None}
        except RuntimeError as e:
            outcome = {"error": str(e)}
        outcome["elapsed"] = time.monotonic() - start
    acc.wait_for_everyone()
    later = acc.save_state(folder)  # every process: the processes are still in step
    acc.wait_for_everyone()
    return {"outcome": outcome, "later": os.path.isfile(os.path.join(later, "manifest.json"))}


def check_fsdp2_main_only_save_is_one_clear_error():
    from hasten import progress
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

    try:
        acc, model, opt, loader = _run(fsdp_plugin=Plugin(fsdp_version=2),
                                       kwargs_handlers=[InitProcessGroupKwargs(hang_timeout=4)])
        _micro_step(acc, model, opt, next(iter(loader)))
        return _main_only_refused(acc, _tmp("fsdp_main_only"))
    finally:
        progress.set_hang_timeout(None)


def check_automatic_naming_main_only_save_is_one_clear_error():
    from hasten import progress

    try:
        acc, model, opt, loader = _run(kwargs_handlers=[InitProcessGroupKwargs(hang_timeout=4)],
                                       project_config=ProjectConfiguration(_tmp("auto_main_only"),
                                                                           automatic_checkpoint_naming=True))
        return _main_only_refused(acc)
    finally:
        progress.set_hang_timeout(None)


def check_a_failure_of_process_0_is_raised_on_every_process():
    """Every process saves; process 0 cannot (the folder it names is a file): process 1, which waits for its
    outcome, raises process 0's error instead of waiting for the process group's timeout."""
    target = _tmp("a_file")
    acc, model, opt, loader = _run()
    if acc.is_main_process:
        with open(target, "w") as f:
            f.write("not a folder")
    acc.wait_for_everyone()
    start = time.monotonic()
    try:
        acc.save_state(target)
        error = None
    except (ValueError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "elapsed": time.monotonic() - start}
