"""Activation checkpointing under DDP, FSDP2 and tensor parallelism inside each rank (see
test_activation_checkpointing.py): one AdamW step of a tiny Llama with each mode against the same
step without checkpointing, under the same strategy. Loss, gradients (full tensors) and the
parameters after the step are compared; the worst absolute difference per mode is reported."""

import torch

from distributed import reset_state
from hasten import Accelerator
from hasten.utils import ActivationCheckpointingKwargs
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from hasten.utils.parallelism_config import ParallelismConfig

MODES = {"full": {"mode": "full"}, "selective": {"mode": "selective"}, "every_2": {"mode": "every_k", "every": 2},
         "full_offload": {"mode": "full", "offload": True}}
STRIP = "_checkpoint_wrapped_module."


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _step(make_accelerator, setting=None):
    """One step; returns the loss, the full gradients and the full parameters after AdamW, on CPU,
    and how many checkpoint wrappers the model holds."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    reset_state()
    acc = make_accelerator(setting)
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(10 + acc.process_index)
    ids = torch.randint(0, 64, (2, 16), generator=g).to(acc.device)
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    grads = {k.replace(STRIP, ""): _full(p.grad).detach().cpu().clone()
             for k, p in acc.unwrap_model(model).named_parameters()}
    opt.step()
    params = {k: v.cpu() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}
    wrapped = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    return {"loss": loss.detach().cpu().reshape(1), **{"g." + k: v for k, v in grads.items()},
            **{"p." + k: v for k, v in params.items()}}, wrapped


def _worst(got, ref):
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return max(float((got[k].float() - ref[k].float()).abs().max()) for k in ref)


def _compare(make_accelerator, modes=MODES):
    ref, none = _step(make_accelerator)
    assert none == 0
    worst, wrapped = {}, []
    for name, setting in modes.items():
        got, count = _step(make_accelerator, setting)
        worst[name] = _worst(got, ref)
        wrapped.append(count)
    return {"worst": worst, "wrapped": min(wrapped)}  # checkpoint wrappers in the model of each mode: the fewest


def _handlers(setting):
    return [ActivationCheckpointingKwargs(**setting)] if setting is not None else []


def check_ddp():
    return _compare(lambda s: Accelerator(kwargs_handlers=_handlers(s)))


def check_fsdp2():
    return _compare(lambda s: Accelerator(fsdp_plugin=Plugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP"),
                                          kwargs_handlers=_handlers(s)))


def check_fsdp2_plugin_flags():
    """Accelerate's flags: activation_checkpointing (+ _offload) on the auto-wrapped layers."""
    def make(flags):
        return Accelerator(fsdp_plugin=Plugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", **(flags or {})))

    return _compare(make, {"flag": {"activation_checkpointing": True},
                           "flag_offload": {"activation_checkpointing": True,
                                            "activation_checkpointing_offload": True}})


def check_tp():
    return _compare(lambda s: Accelerator(parallelism_config=ParallelismConfig(tp_size=2), kwargs_handlers=_handlers(s)))
