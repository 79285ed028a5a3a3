"""Tensor and N-D parallelism inside each rank (see distributed.py and test_tp.py).

Run on 2 processes (tp alone) and on 4 (dp_shard x tp, HSDP); each check looks at the world
size and the environment to pick its layout. References are computed on one process, locally, on
the rank's device; they are compared on CPU, where the strategy's full state dict is.
"""

import json
import os

import torch
from torch import nn

from distributed import mesh_facts, reset_state
from hasten import Accelerator
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from hasten.utils.parallelism_config import ParallelismConfig

FEATURES, HIDDEN, N = 6, 16, 24
MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, FEATURES), nn.Tanh(),
                         nn.Linear(FEATURES, 1))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())


def _accelerator(fsdp: bool = False, **sizes) -> Accelerator:
    reset_state()
    return Accelerator(parallelism_config=ParallelismConfig(**sizes),
                       fsdp_plugin=Plugin(fsdp_version=2) if fsdp else None)


def _full(acc, model) -> dict:
    return {k: v.clone() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}


def _worst(got: dict, ref: dict) -> float:
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


def _cpu(state: dict) -> dict:
    return {k: v.cpu() for k, v in state.items()}


def _mlp_reference(steps, per_replica, replicas, clip, device):
    model = _mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(torch.utils.data.DataLoader(_data(), batch_size=per_replica))
    norms = []
    for step in range(steps):
        group = batches[step * replicas:(step + 1) * replicas]
        x, y = torch.cat([b[0] for b in group]).to(device), torch.cat([b[1] for b in group]).to(device)
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return _cpu(model.state_dict()), norms


def _mlp_equivalence(acc, steps=3, clip=0.5):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=2))
    norms, it = [], iter(loader)
    for _ in range(steps):
        x, y = next(it)
        acc.backward(nn.functional.mse_loss(model(x), y))
        norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    ref, ref_norms = _mlp_reference(steps, 2, acc.strategy.mesh.dp_size, clip, acc.device)
    worst = _worst(_full(acc, model), ref)
    assert worst < 1e-5, worst
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) < 1e-5, (norms, ref_norms)
    assert type(model[0].weight).__name__ == "DTensor"
    return {"worst": worst, "placements": str(model[0].weight.placements)}


def _gather_exact(acc):
    """Every sample once, in order, on every process (the tp ranks of a replica share batches)."""
    ds = torch.utils.data.TensorDataset(torch.arange(13.0).unsqueeze(1))
    loader = acc.prepare(torch.utils.data.DataLoader(ds, batch_size=2))
    seen = [acc.gather_for_metrics(x) for (x,) in loader]
    got = torch.cat(seen).flatten().tolist()
    assert got == list(range(13)), got
    return got


# -- 2 processes: tensor parallelism alone ---------------------------------------------------------
def check_tp_mlp_equals_one_process():
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_plan=MLP_PLAN))
    assert type(acc.strategy).__name__ == "TensorParallelStrategy" and acc.strategy.mesh.dp_size == 1
    return _mlp_equivalence(acc)


def check_tp_llama_plan_equals_one_process():
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    acc = _accelerator(tp_size=2)
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    ref = _llama().to(acc.device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g).to(acc.device)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(loss), float(ref_loss)))
    split = [n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"]
    assert "model.layers.0.self_attn.q_proj.weight" in split and "lm_head.weight" in split, split
    worst = _worst(_full(acc, model), _cpu(ref.state_dict()))
    assert worst < 1e-5, (worst, losses)
    return {"worst": worst, "split": len(split)}


def check_tp_qwen3_plan_with_accumulation_equals_one_process():
    """Qwen3 (dense) under its own tp plan, TP alone, gradient accumulation 2: its per-head q_norm/k_norm
    weights stay whole and their gradients are summed over tp at each backward (``GradientSum``), so the
    accumulated sums equal one process's gradients."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def build():
        torch.manual_seed(0)
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            max_position_embeddings=32))

    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(tp_size=2), gradient_accumulation_steps=2)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    ref = build().to(acc.device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (2, 8), generator=g).to(acc.device) for _ in range(4)]
    for i, ids in enumerate(batches):
        with acc.accumulate(model):
            acc.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
        (ref(input_ids=ids, labels=ids).loss / 2).backward()
        if i % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad()
    norm = model.model.layers[0].self_attn.q_norm.weight
    assert type(norm).__name__ != "DTensor" and tuple(norm.shape) == (8,)  # whole on both processes
    worst = _worst(_full(acc, model), _cpu(ref.state_dict()))
    norms = max(float((p.detach().cpu() - ref.get_parameter(n).detach().cpu()).abs().max())
                for n, p in model.named_parameters() if "norm" in n and "layernorm" not in n)
    return {"worst": worst, "q_k_norms": norms}


def check_tp_gather_for_metrics_exact():
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    return _gather_exact(_accelerator(tp_size=2))


def check_tp_checkpoint_roundtrip():
    """TP save -> TP load (bitwise), then the no-TP checkpoint from one process -> TP."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    folder = os.path.join(os.environ["TP_TMP"], "tp_ckpt")
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_plan=MLP_PLAN))
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=4))
    it = iter(loader)
    for _ in range(2):
        x, y = next(it)
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    acc.save_state(folder)
    saved = _full(acc, model)
    x, y = next(it)
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    after_one = _full(acc, model)

    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_plan=MLP_PLAN))
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=4))
    acc.load_state(folder, continue_dataloaders=True)
    assert all(torch.equal(saved[k], v) for k, v in _full(acc, model).items())
    x, y = next(iter(loader))  # the data position came back too: third batch
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    assert all(torch.equal(after_one[k], v) for k, v in _full(acc, model).items())  # Adam state came back
    with open(os.path.join(folder, "manifest.json")) as f:
        layout = json.load(f)["layout"]

    reset_state()  # a checkpoint written by one process without TP, loaded under TP
    acc = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_plan=MLP_PLAN))
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    acc.load_state(os.environ["TP_SINGLE_CKPT"], continue_dataloaders=True)
    assert len(opt.state) == 6
    return {"layout": layout, "saved": {k: v.tolist() for k, v in saved.items()},
            "from_single": {k: v.tolist() for k, v in _full(acc, model).items()}}


def check_tp_device_mesh_and_fp16_overflow_on_one_process():
    """The mesh is Accelerate's (``tp`` only, no flattened data-parallel dims); fp16 trains a model whose last
    layer is outside the plan (DTensor and plain gradients), and an overflow in one process's gradient
    shard skips the step on both (they hold different shards of the same weights)."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    reset_state()
    from hasten.utils import GradScalerKwargs

    acc = Accelerator(mixed_precision="fp16", parallelism_config=ParallelismConfig(tp_size=2, tp_plan=MLP_PLAN),
                      kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])  # only the forced overflow skips
    facts = mesh_facts(acc)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=4))
    steps = []
    for x, y in loader:
        before = _full(acc, model)
        acc.backward(nn.functional.mse_loss(model(x), y))
        if len(steps) == 1 and acc.process_index == 1:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
        changed = any(not torch.equal(before[k], v) for k, v in _full(acc, model).items())
        steps.append([acc.optimizer_step_was_skipped, changed])
        if len(steps) == 3:
            break
    assert steps == [[False, True], [True, False], [False, True]], steps
    return facts


def check_tp_bad_heads_named_before_communication():
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    from transformers import LlamaConfig, LlamaForCausalLM

    acc = _accelerator(tp_size=2)
    cfg = LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3,
                      num_key_value_heads=3, max_position_embeddings=32)
    try:
        acc.prepare(LlamaForCausalLM(cfg))
    except ValueError as e:
        assert "tp_size=2 does not divide num_attention_heads=3" in str(e), str(e)
        return str(e)
    raise AssertionError("no error")


def check_tp_with_fsdp_over_dp_shard_of_one():
    """tp_size=2 with FSDP and dp_shard_size=1 (as Accelerate accepts): FSDP2 over a shard dimension of one
    process on top of the tensor-parallel split; trains like one process, checkpoint round trip."""
    if int(os.environ["WORLD_SIZE"]) != 2:
        return "skipped"
    reset_state()
    config = ParallelismConfig(tp_size=2, dp_shard_size=1, tp_plan=MLP_PLAN)
    acc = Accelerator(parallelism_config=config, fsdp_plugin=Plugin(fsdp_version=2))
    assert type(acc.strategy).__name__ == "FSDP2Strategy" and acc.distributed_type == "FSDP"
    out = _mlp_equivalence(acc)
    model = acc._models[0]
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model, FSDPModule)
    assert model[0].weight.device_mesh.mesh_dim_names == ("dp_shard", "tp"), model[0].weight.device_mesh
    assert model[4].weight.to_local().shape == model[4].weight.shape  # not in the plan, dp_shard of one: whole
    out["mesh"] = mesh_facts(acc)
    folder = os.path.join(os.environ["TP_TMP"], "tp_fsdp_ckpt")
    opt = acc._optimizers[0]
    acc.save_state(folder)
    saved = _full(acc, model)
    acc.backward(model(torch.randn(2, FEATURES, device=acc.device)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    acc.load_state(folder, continue_dataloaders=True)
    assert all(torch.equal(saved[k], v) for k, v in _full(acc, model).items())
    return out


# -- 4 processes: dp_shard x tp and HSDP ------------------------------------------------------------
def check_dp_shard_times_tp_equals_one_process():
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2, tp_plan=MLP_PLAN),
                      fsdp_plugin=Plugin(fsdp_version=2))
    out = _mlp_equivalence(acc)
    out["mesh"] = mesh_facts(acc)
    assert "Shard(dim=0), Shard(dim=0)" in out["placements"] or "_StridedShard" in out["placements"], out
    out["gathered"] = len(_gather_exact(acc))
    return out


def check_hsdp_equals_one_process():
    if int(os.environ["WORLD_SIZE"]) != 4:
        return "skipped"
    acc = _accelerator(fsdp=True, dp_replicate_size=2, dp_shard_size=2)
    assert acc.strategy.mesh.dp_size == 4
    out = _mlp_equivalence(acc)
    assert out["placements"] == "(Replicate(), Shard(dim=0))", out
    return out
