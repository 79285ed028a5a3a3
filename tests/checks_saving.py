"""Checks of saving with several processes, run inside each rank (see distributed.py)."""

import dataclasses
import os

import torch
from torch import nn

from hasten.model_loading import load_checkpoint_in_model
from hasten.saving import save, save_model
from hasten.state import PartialState


class Tiny(nn.Module):
    """A small model with a buffer and (optionally) an output layer tied to the embedding."""

    def __init__(self, tie: bool = True, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, hidden)
        self.out = nn.Linear(hidden, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.register_buffer("steps", torch.tensor(0))
        if tie:
            self.lm_head.weight = self.embed.weight


def seeded(seed: int, **kwargs) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny(**kwargs)
    model.steps.fill_(seed + 100)
    return model


def _dir(name: str) -> str:
    path = os.path.join(os.environ["HASTEN_TEST_TMP"], name)
    os.makedirs(path, exist_ok=True)
    return path


def _temps(root: str) -> list:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


def check_only_main_writes():
    s = PartialState()
    rank = s.process_index
    root = _dir("only_main")
    # Called on rank 1 alone: nothing may appear.
    if rank == 1:
        save({"x": torch.ones(1)}, os.path.join(root, "lone.pt"))
        save({"x": torch.ones(1)}, os.path.join(root, "lone.safetensors"), safe_serialization=True)
        save_model(Tiny().state_dict(), os.path.join(root, "lone_dir"))
    s.wait_for_everyone()
    lone = sorted(os.listdir(root))
    s.wait_for_everyone()

    # Called on both ranks at once with different contents: rank 0's content wins, written once.
    model = seeded(rank)
    save({"rank": torch.tensor([rank])}, os.path.join(root, "both.pt"))
    save({"w": torch.full((3,), float(rank))}, os.path.join(root, "both.safetensors"), safe_serialization=True)
    save_model(model.state_dict(), os.path.join(root, "sharded"), max_shard_size=300)
    save_model(model.state_dict(), os.path.join(root, "bin"), safe_serialization=False)
    s.wait_for_everyone()

    from safetensors.torch import load_file

    expected = seeded(0)
    loaded = {}
    for name in ("sharded", "bin"):
        fresh = seeded(7)
        load_checkpoint_in_model(fresh, os.path.join(root, name))
        same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), expected.state_dict().values()))
        loaded[name] = {"equal_to_rank0": same, "tied": fresh.lm_head.weight is fresh.embed.weight,
                        "files": sorted(os.listdir(os.path.join(root, name)))}
    result = {
        "lone": lone,
        "pt_rank": torch.load(os.path.join(root, "both.pt"), weights_only=True)["rank"].item(),
        "safetensors_value": load_file(os.path.join(root, "both.safetensors"))["w"].tolist(),
        "loaded": loaded,
        "temps": _temps(root),
    }
    s.wait_for_everyone()
    return result


def check_save_on_each_node():
    s = PartialState()
    rank = s.process_index
    root = _dir("each_node")
    # The real layout: both ranks on one node, so only local rank 0 writes.
    save({"rank": torch.tensor(rank)}, os.path.join(root, "shared.pt"), save_on_each_node=True)
    s.wait_for_everyone()
    shared_rank = torch.load(os.path.join(root, "shared.pt"), weights_only=True)["rank"].item()

    # Pretend two nodes of one process each, each node with its own disk (a folder per node).
    real = s.topology
    s.topology = dataclasses.replace(real, local_rank=0, local_world_size=1, node_rank=rank, num_nodes=2)
    try:
        assert s.is_local_main_process and s.is_main_process == (rank == 0)
        node = _dir(f"each_node/node{rank}")
        save({"node": torch.tensor(rank)}, os.path.join(node, "per_node.pt"), save_on_each_node=True)
        save({"node": torch.tensor(rank)}, os.path.join(node, "main_only.pt"))
    finally:
        s.topology = real
    s.wait_for_everyone()
    per_node, main_only = {}, {}
    for r in range(s.num_processes):
        node = os.path.join(root, f"node{r}")
        per_node[r] = torch.load(os.path.join(node, "per_node.pt"), weights_only=True)["node"].item()
        main_only[r] = os.path.exists(os.path.join(node, "main_only.pt"))
    s.wait_for_everyone()
    return {"shared_rank": shared_rank, "per_node": per_node, "main_only": main_only}
