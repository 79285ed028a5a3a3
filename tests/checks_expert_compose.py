"""Expert parallelism composed with pipeline stages, on 4 real gloo processes (test_expert_compose.py).

pp_size=2 x dp_shard_size=2 with ep_size=2: each stage's dp_shard pair splits that stage's experts (the
experts' mesh is per stage). Compared with one process on the same global batches: losses, the first
update's gradients, the clipped norms and the parameters after 3 AdamW steps (gradient accumulation 2).
"""

import os

import torch

from checks_pipeline_compose import ACCUM, _compare, _lm_full_data, _lm_ref
from distributed import reset_state
from hasten import Accelerator
from hasten.strategies.expert_parallel import expert_modules
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from hasten.utils.parallelism_config import ParallelismConfig


def _qwen3_moe(router_loss: bool = False):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, output_router_logits=router_loss, router_aux_loss_coef=0.1,
                         max_position_embeddings=32)
    return Qwen3MoeForCausalLM(cfg)


def _pp_ep() -> Accelerator:
    reset_state()
    return Accelerator(gradient_accumulation_steps=ACCUM, fsdp_plugin=Plugin(fsdp_version=2),
                       parallelism_config=ParallelismConfig(pp_size=2, dp_shard_size=2, ep_size=2,
                                                            pp_schedule="1F1B", pp_microbatches=2))


def check_pp2_with_ep2_equals_one_process():
    """Each stage's 2 decoder layers' experts split over its dp_shard pair; no router loss (refused under pp)."""
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    acc = _pp_ep()
    assert type(acc.strategy).__name__ == "PipelineStrategy"
    out = _compare(acc, _qwen3_moe, _lm_full_data(24), 2, 2, _lm_ref)
    model = acc._models[0]
    experts = [m for _, stage in model.local_stages() for m in expert_modules(stage)]
    first = experts[0].gate_up_proj
    ep_group = first.device_mesh["ep"].mesh.flatten().tolist()
    out.update(mesh=repr(acc.strategy.mesh), experts=len(experts), local_shape=list(first.to_local().shape),
               ep_ranks=ep_group, classes=sorted({type(m).__name__ for m in experts}))
    return out


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        output_router_logits=False, max_position_embeddings=32)
    return MixtralForCausalLM(cfg)


def check_pp2_with_tp2_and_ep2_equals_one_process():
    """pp_size=2 x tp_size=2 with ep_size=2 (Mixtral): each stage's tp pair splits the attention by the tp
    plan and that stage's experts whole (ep borrows the tp pair, each sending half of the shared tokens)."""
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=ACCUM, fsdp_plugin=Plugin(fsdp_version=2),
                      parallelism_config=ParallelismConfig(pp_size=2, tp_size=2, ep_size=2, pp_schedule="1F1B",
                                                           pp_microbatches=2))
    # AdamW's eps 1e-4: the first update's gradients equal one process's within 4e-8, but some are ~1e-8 and
    # differ by 1e-10 (the tp split's summation order); with a smaller eps Adam turns that into 1e-5 of
    # weight and clip norm by the third step (checks_pipeline_matrix.TP_EPS says the same of pp x tp).
    out = _compare(acc, _mixtral, _lm_full_data(12), 2, 1, _lm_ref, eps=1e-4)
    model = acc._models[0]
    experts = [m for _, stage in model.local_stages() for m in expert_modules(stage)]
    out.update(mesh=repr(acc.strategy.mesh), experts=len(experts), local_shape=list(experts[0].gate_up_proj.to_local().shape),
               ep_ranks=experts[0].gate_up_proj.device_mesh["ep"].mesh.flatten().tolist())
    return out


def check_router_aux_loss_under_pp_is_refused_in_one_line():
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    acc = _pp_ep()
    try:
        acc.prepare(_qwen3_moe(router_loss=True))
    except ValueError as e:
        return str(e)
    raise AssertionError("prepare accepted a model whose loss adds the router's loss under pp")
