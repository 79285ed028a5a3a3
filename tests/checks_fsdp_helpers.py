"""Rank-side checks for test_fsdp_helpers.py: Accelerate's FSDP save/load/merge helpers on 2 real
FSDP2 processes, with the plugin built as Accelerate's own scripts build it (torch's enum)."""

from __future__ import annotations

import os

import torch
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(acc, model, optimizer) -> None:
    g = torch.Generator().manual_seed(1 + acc.process_index)
    for _ in range(2):
        x = torch.randn(8, 16, generator=g).to(acc.device)
        acc.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _weights(acc, model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(acc.unwrap_model(model), options=StateDictOptions(full_state_dict=True))


def _optimizer_numbers(acc, model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(acc.unwrap_model(model), optimizer.optimizer,
                                    options=StateDictOptions(full_state_dict=True))  # on every rank
    return {f"{k}.{n}": v for k, s in full["state"].items() for n, v in s.items() if torch.is_tensor(v)}


def check_save_load_merge():
    from safetensors.torch import load_file
    from torch.distributed.fsdp import StateDictType

    from distributed import reset_state
    from hasten import Accelerator, FullyShardedDataParallelPlugin
    from hasten.utils import (load_fsdp_model, load_fsdp_optimizer, merge_fsdp_weights, save_fsdp_model,
                              save_fsdp_optimizer)

    out = os.environ["HASTEN_TEST_TMP"]
    facts = {}
    for kind in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT):
        reset_state()
        plugin = FullyShardedDataParallelPlugin(state_dict_type=kind, fsdp_version=2)
        acc = Accelerator(fsdp_plugin=plugin)
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = acc.prepare(model, optimizer)
        _train(acc, model, optimizer)
        folder = os.path.join(out, kind.name)
        save_fsdp_model(plugin, acc, model, folder)
        save_fsdp_optimizer(plugin, acc, optimizer, model, folder)
        trained, trained_optim = _weights(acc, model), _optimizer_numbers(acc, model, optimizer)
        facts[kind.name] = sorted(os.listdir(folder))

        fresh = nn.Sequential(*(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)))
        fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        fresh, fresh_optim = acc.prepare(fresh, fresh_optim)
        assert not _same(_weights(acc, fresh), trained)
        load_fsdp_model(plugin, acc, fresh, folder)
        load_fsdp_optimizer(plugin, acc, fresh_optim, fresh, folder)
        assert _same(_weights(acc, fresh), trained), kind
        assert _same(_optimizer_numbers(acc, fresh, fresh_optim), trained_optim), kind
        if kind is StateDictType.SHARDED_STATE_DICT and acc.is_main_process:
            merged = os.path.join(out, "merged")
            merge_fsdp_weights(os.path.join(folder, "pytorch_model_fsdp_0"), merged)
            merge_fsdp_weights(os.path.join(folder, "pytorch_model_fsdp_0"), merged)  # again: replaces, as Accelerate
            assert _same(load_file(os.path.join(merged, "model.safetensors")), trained)
        acc.wait_for_everyone()
    return facts
