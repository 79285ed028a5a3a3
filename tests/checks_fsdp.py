"""FSDP2 inside each rank (see distributed.py and test_fsdp.py): equivalence with one process,
bf16, transformer-layer wrapping, exact resume, loads across layouts, rank-0 loading, bad input."""

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils import set_seed
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

FEATURES, N = 6, 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
                         nn.Linear(16, 1))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())


def _accelerator(**plugin) -> Accelerator:
    reset_state()
    return Accelerator(fsdp_plugin=Plugin(fsdp_version=2, **plugin))


def _full(acc: Accelerator, model: nn.Module) -> dict:
    return {k: v.clone() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}


def _train(acc, model, opt, loader, steps, clip=None):
    norms, losses = [], []
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if clip is not None and acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
        losses.append(float(loss))
    return norms, losses


def _reference(steps, accum, clip, per_process_batch, world):
    """One process, plain model, global batch = world x per-process batch (the sampler's interleaving)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = _data()
    norms = []
    batches = list(torch.utils.data.DataLoader(ds, batch_size=per_process_batch))
    for step in range(steps):
        group = batches[step * world:(step + 1) * world]
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        loss = nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        if (step + 1) % accum == 0:
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    return model.state_dict(), norms


def _equivalence(accum, clip, wrap):
    acc = _accelerator(auto_wrap_policy=wrap, min_num_params=100)
    acc.gradient_accumulation_steps = accum
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 4 * accum
    norms, _ = _train(acc, model, opt, loader, steps, clip)
    ref, ref_norms = _reference(steps, accum, clip, 2, acc.num_processes)
    got = _full(acc, model)
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-5, worst
    assert all(abs(a - b) < 1e-5 for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    assert type(model.state_dict()["0.weight"]).__name__ == "DTensor"
    return {"worst": worst, "norms": norms}


def check_equivalence_plain():
    return _equivalence(1, None, "NO_WRAP")


def check_equivalence_accumulation_clipping():
    return _equivalence(2, 0.05, "SIZE_BASED_WRAP")


def check_bf16_trains():
    reset_state()
    acc = Accelerator(mixed_precision="bf16", fsdp_plugin=Plugin(fsdp_version=2, activation_checkpointing=True,
                                                                auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=4))
    losses = []
    for _ in range(6):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    assert sum(losses[-4:]) < sum(losses[:4]), losses  # the last epoch against the first
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    return losses[0], losses[-1]


def check_transformers_layer_wrap():
    from transformers import LlamaConfig, LlamaForCausalLM

    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    from torch.distributed.fsdp import FSDPModule

    wrapped = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(acc.process_index))
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    assert sum("LlamaDecoderLayer" in w for w in wrapped) == 2, wrapped
    return wrapped


def _batches(loader):
    while True:
        yield from loader


def _run(acc, model, opt, batches, steps, save_dir=None, save_at=None):
    """``steps`` optimizer steps over the endless ``batches``; saves before step ``save_at``."""
    losses = []
    for step in range(steps):
        if save_at is not None and step == save_at:
            acc.save_state(save_dir)
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _setup(plugin=True, efficient=False):
    reset_state()
    set_seed(3)
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100)
                      if plugin else None)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_data(), batch_size=3, shuffle=True)
    return acc, *acc.prepare(model, opt, loader)


def check_bitwise_resume():
    folder = os.path.join(os.environ["FSDP_TMP"], "resume")
    acc, model, opt, loader = _setup()
    whole = _run(acc, model, opt, _batches(loader), 18, folder, save_at=7)  # mid-epoch (6 steps per epoch)
    final = _full(acc, model)
    acc, model, opt, loader = _setup()
    reads, read = [], dcp.FileSystemReader.read_metadata
    dcp.FileSystemReader.read_metadata = lambda self, *a, **k: reads.append(1) or read(self, *a, **k)
    try:
        acc.load_state(folder)
    finally:
        dcp.FileSystemReader.read_metadata = read
    at_save = {k: v.tolist() for k, v in _full(acc, model).items()}
    rest = _run(acc, model, opt, _batches(loader), 11)
    again = _full(acc, model)
    assert rest == whole[7:], (rest, whole[7:])
    assert all(torch.equal(final[k], again[k]) for k in final)
    import json

    with open(os.path.join(folder, "manifest.json")) as f:
        layout = json.load(f)["layout"]
    return {"layout": layout, "at_save": at_save, "saved_losses": whole[7:], "metadata_reads": len(reads)}


def check_ddp_checkpoint_into_fsdp():
    folder = os.path.join(os.environ["FSDP_TMP"], "ddp")
    acc, model, opt, loader = _setup(plugin=False)
    batches = _batches(loader)
    _run(acc, model, opt, batches, 5)
    acc.save_state(folder)
    expected = _full(acc, model)
    rest_ddp = _run(acc, model, opt, batches, 4)
    acc, model, opt, loader = _setup()
    acc.load_state(folder)
    got = _full(acc, model)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    rest = _run(acc, model, opt, _batches(loader), 4)
    assert max(abs(a - b) for a, b in zip(rest, rest_ddp)) < 1e-5, (rest, rest_ddp)  # optimizer state came along
    return rest


def check_fsdp_checkpoint_into_ddp():
    folder = os.path.join(os.environ["FSDP_TMP"], "resume")  # written by check_bitwise_resume
    acc, model, opt, loader = _setup(plugin=False)
    acc.load_state(folder)
    return _run(acc, model, opt, _batches(loader), 11)


def check_single_process_checkpoint_into_fsdp():
    folder = os.environ["FSDP_SINGLE_CKPT"]
    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2))
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=0.01))  # built on the sharded parameters
    acc.load_state(folder)
    assert len(opt.state) == 6
    return {k: v.tolist() for k, v in _full(acc, model).items()}


def check_layout_mismatch_changes_nothing():
    folder = os.path.join(os.environ["FSDP_TMP"], "resume")
    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 8), nn.Tanh()),
                          nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, _ = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=3, shuffle=True))
    before = _full(acc, model)
    try:
        acc.load_state(folder)
    except Exception as e:  # noqa: BLE001
        message = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("a checkpoint of other shapes loaded")
    after = _full(acc, model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "shapes differ for 2.0.weight (checkpoint [16, 16], model [8, 16])" in message, message
    return message


def check_cpu_ram_efficient_loading():
    from hasten import init_empty_weights

    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, cpu_ram_efficient_loading=True,
                                         auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100))
    if acc.is_main_process:
        model = _model()
    else:
        with init_empty_weights():
            model = _model()
        assert all(p.is_meta for p in model.parameters())
    model = acc.prepare(model)
    got = _full(acc, model)
    expected = _model().state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    return sorted(got)


def check_optimizer_of_unprepared_model():
    acc = _accelerator()
    model, other = _model(), nn.Linear(2, 2)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    try:
        acc.prepare(model, opt)
    except ValueError as e:
        assert "belongs to no model prepared" in str(e) and "[2, 2]" in str(e), str(e)
        return str(e)
    raise AssertionError("no error")


def check_user_sharded_model_accepted():
    from torch.distributed.fsdp import fully_shard

    reset_state()
    acc = Accelerator()  # plain DDP setup; the user shards himself (torchtitan style)
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, opt = acc.prepare(model, opt)
    assert prepared is model
    x = torch.randn(4, FEATURES)
    acc.backward(model(x).sum())
    opt.step()
    return acc.strategy.checkpoint_format


def check_save_model_streams_full_weights():
    from safetensors.torch import load_file

    acc, model, opt, loader = _setup()
    folder = os.path.join(os.environ["FSDP_TMP"], "weights")
    acc.save_model(model, folder, max_shard_size=600)
    acc.wait_for_everyone()
    full = _full(acc, model)
    names = sorted(os.listdir(folder))
    got = {}
    for name in names:
        if name.endswith(".safetensors"):
            got.update(load_file(os.path.join(folder, name)))
    assert set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    return names
