"""Every Python snippet in README.md and docs/*.md runs, or says why it cannot.

Each ```python block must follow a marker line:

* ``<!-- snippet: run -->`` runs the block as it stands;
* ``<!-- snippet: run prelude=NAME processes=N -->`` runs it after the named prelude below (the
  objects the surrounding prose assumes: a model, an optimizer, a dataloader, a saved checkpoint),
  under ``hasten launch --cpu --num_processes N`` when N > 1;
* ``<!-- snippet: skip REASON -->`` does not run it, and the reason is shown on the page's source.

A new block without a marker fails ``test_every_snippet_has_a_marker``, so no snippet goes untested
by accident.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                               if name.endswith(".md"))
MARKER = re.compile(r"<!--\s*snippet:\s*(run|skip)\b(.*?)-->")

# What the prose around a snippet assumes exists. Small, CPU-only, made here.
PRELUDES = {
    # A model that returns ``.loss`` as transformers models do, dict batches, an optimizer, a scheduler.
    "loop": """
        import torch
        from types import SimpleNamespace
        from torch.utils.data import DataLoader
        from hasten import Accelerator

        torch.manual_seed(0)

        class TinyModel(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 1)

            def forward(self, x, y):
                return SimpleNamespace(loss=torch.nn.functional.mse_loss(self.net(x), y))

        data = [{"x": torch.randn(8), "y": torch.randn(1)} for _ in range(64)]
        model = TinyModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        train_dl = loader = DataLoader(data, batch_size=8, shuffle=True)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4)
        num_epochs = 2
        loss = torch.tensor(0.0)  # what the snippets' "..." computed

        def train_step(batch):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    """,
    # The same, already prepared.
    "prepared": """
        accelerator = Accelerator()
        model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    """,
    # A tiny Llama saved with save_pretrained (tied embeddings), where the snippets look for it.
    "checkpoint": """
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(config).eval()
        for folder in ("path/to/checkpoint", "path/to/model"):
            reference.save_pretrained(folder)
        input_ids = torch.randint(0, 128, (2, 6))
    """,
    # A tiny Llama with dict batches of token ids.
    "llama": """
        import torch
        from torch.utils.data import DataLoader
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 128, (16, 8))
        loader = DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=4)
    """,
    "launchers": """
        def train(cfg):
            from hasten import Accelerator
            accelerator = Accelerator(cpu=True)
            accelerator.wait_for_everyone()

        cfg = {}
    """,
}


def _blocks(page: str) -> list[tuple[int, str, str, str]]:
    """``(line, kind, options, code)`` of each ```python block of ``page``; kind is "" with no marker."""
    lines = open(os.path.join(ROOT, page), encoding="utf-8").read().splitlines()
    found, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            start = index
            previous = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
            marker = MARKER.search(previous)
            index += 1
            body = []
            while index < len(lines) and lines[index].strip() != "```":
                body.append(lines[index])
                index += 1
            found.append((start + 1, marker.group(1) if marker else "", marker.group(2).strip() if marker else "",
                          "\n".join(body)))
        index += 1
    return found


SNIPPETS = [(page, *block) for page in PAGES for block in _blocks(page)]


def test_every_snippet_has_a_marker():
    unmarked = [f"{page}:{line}" for page, line, kind, _, _ in SNIPPETS if not kind]
    assert not unmarked, ("python blocks without a '<!-- snippet: run|skip ... -->' line before them: "
                          + ", ".join(unmarked))
    assert len(SNIPPETS) >= 10  # the parser sees the pages' blocks


def _options(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


RUNNABLE = [pytest.param(page, line, options, code, id=f"{page}:{line}")
            for page, line, kind, options, code in SNIPPETS if kind == "run"]


@pytest.mark.parametrize("page, line, options, code", RUNNABLE)
def test_snippet_runs(page, line, options, code, tmp_path):
    settings = _options(options)
    parts = [textwrap.dedent(PRELUDES[name]) for name in settings.get("prelude", "").split(",") if name]
    script = tmp_path / "snippet.py"
    script.write_text("\n".join(parts + [code]) + "\n")
    processes = int(settings.get("processes", "1"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")]))
    command = [sys.executable, str(script)] if processes == 1 else [
        sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", str(processes),
        str(script)]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{page}:{line} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
