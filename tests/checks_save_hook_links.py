"""Save hooks that put symbolic links into the checkpoint folder, on 1 and 2 processes (see distributed.py)."""

import os

import torch
from torch import nn

from hasten import Accelerator
from hasten.checkpointing import layout
from hasten.utils import ProjectConfiguration


def _tmp(name):
    return os.path.join(os.environ["HASTEN_TEST_TMP"], name)


def _setup(name):
    torch.manual_seed(0)
    acc = Accelerator(project_config=ProjectConfiguration(_tmp(name), automatic_checkpoint_naming=True,
                                                          total_limit=1))
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _outside(name, make):
    """A file or folder outside every checkpoint (made by process 0), as a tokenizer kept elsewhere."""
    path = _tmp(name)
    if not os.path.lexists(path) and int(os.environ.get("RANK", "0")) == 0:
        make(path)
    return path


def _write(path):
    with open(path, "w") as f:
        f.write('{"vocab": ["a", "b"]}')


def _save(acc, background):
    folder = acc.save_state(blocking=not background)
    if background:
        acc.wait_for_checkpoint()
    return folder


def _checkpoints(acc):
    root = os.path.join(acc.project_dir, "checkpoints")
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def check_a_linked_file_is_stored_as_a_copy():
    out = {}
    for background in (False, True):
        acc, model, opt = _setup(f"copied_{background}")
        tokenizer = _outside("tokenizer.json", _write)
        _save(acc, background)

        def hook(models, weights, folder):
            if acc.is_main_process:
                os.symlink(tokenizer, os.path.join(folder, "tokenizer.json"))

        handle = acc.register_save_state_pre_hook(hook)
        folder = _save(acc, background)
        handle.remove()
        layout.wait_for_deletions()
        acc.wait_for_everyone()
        stored = os.path.join(folder, "tokenizer.json")
        with torch.no_grad():
            acc.unwrap_model(model).weight.add_(1.0)
        loaded = acc.load_state()
        out[str(background)] = {"link": os.path.islink(stored), "bytes": open(stored).read(),
                                "left": _checkpoints(acc), "loaded": os.path.basename(loaded)}
        acc.wait_for_everyone()
    return out


def check_a_link_that_cannot_be_stored_is_refused_and_the_older_checkpoint_kept():
    out = {}
    targets = {"folder": _outside("tokenizer_dir", os.makedirs), "dangling": _tmp("no_such_file.json")}
    for kind, target in targets.items():
        for background in (False, True):
            acc, model, opt = _setup(f"refused_{kind}_{background}")
            _save(acc, background)

            def hook(models, weights, folder):
                if acc.is_main_process:
                    os.symlink(target, os.path.join(folder, "tokenizer"))

            handle = acc.register_save_state_pre_hook(hook)
            try:
                _save(acc, background)
                error = ""
            except RuntimeError as e:
                error = str(e)
            handle.remove()
            acc.wait_for_everyone()
            loaded = acc.load_state()  # the older checkpoint, still there and loadable
            out[f"{kind} {background}"] = {"error": error, "left": _checkpoints(acc),
                                           "loaded": os.path.basename(loaded)}
            acc.wait_for_everyone()
    return out


def check_links_in_a_one_process_save():
    """An unsharded save into a named folder (``checkpointing/solo.py``): process 0 commits alone, the
    others attach their hooks' files afterwards; a link on either side is stored as a copy."""
    acc = Accelerator()
    model = nn.Linear(4, 3)
    model = acc.prepare(model)
    tokenizer = _outside("solo_tokenizer.json", _write)
    acc.wait_for_everyone()
    rank = acc.process_index

    def hook(models, weights, folder):
        os.symlink(tokenizer, os.path.join(folder, f"linked_{rank}.json"))

    handle = acc.register_save_state_pre_hook(hook)
    folder = acc.save_state(_tmp("solo_ckpt"))
    handle.remove()
    acc.wait_for_everyone()
    names = sorted(n for n in os.listdir(folder) if n.startswith("linked_"))
    links = [n for n in names if os.path.islink(os.path.join(folder, n))]
    acc.load_state(folder)
    return {"names": names, "links": links}
