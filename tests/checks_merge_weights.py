"""Rank-side checks for test_merge_weights.py: a tiny transformers model sharded with FSDP2 on 2
processes, one Adam step, then DCP checkpoints of it and the full weights as the reference."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # An odd vocabulary size: FSDP2 pads the first dimension, the estimate must count that too.
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=16, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def check_fsdp2_dcp_checkpoints():
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hasten.state import PartialState

    out = os.environ["HASTEN_TEST_TMP"]
    # The mesh on this rank's device: fully_shard's default mesh takes CUDA whenever a GPU exists, even
    # when the ranks share one GPU and talk over gloo.
    device = PartialState().device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    local = sum(p.to_local().numel() for p in model.parameters())
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(out, "nested"))
    dcp.save(msd, checkpoint_id=os.path.join(out, "plain"))
    dcp.save({"optimizer": osd}, checkpoint_id=os.path.join(out, "optimizer_only"))
    # hasten's own layout for sharded strategies: <checkpoint>/sharded with model_<i> / optimizer_<i> keys.
    dcp.save({"model_0": msd, "model_1": msd, "optimizer_0": osd}, checkpoint_id=os.path.join(out, "hasten_layout"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_file({k: v.clone().contiguous() for k, v in full.items()}, os.path.join(out, "reference.safetensors"))
    dist.barrier()
    return {"dir": out, "local_numel": local, "sharded": type(model.lm_head.weight).__name__}
