"""FSDP2 inside each rank (see distributed.py and test_fsdp.py): equivalence with one process,
bf16, transformer-layer wrapping, exact resume, loads across layouts, rank-0 loading, bad input."""

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from distributed import mesh_facts, reset_state
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


def _reference(steps, accum, clip, per_process_batch, world, device):
    """One process, plain model on ``device``, global batch = world x per-process batch (the sampler's
    interleaving). Returns the weights on CPU, where the strategy's full state dict is."""
    model = _model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = _data()
    norms = []
    batches = list(torch.utils.data.DataLoader(ds, batch_size=per_process_batch))
    for step in range(steps):
        group = batches[step * world:(step + 1) * world]
        x = torch.cat([b[0] for b in group]).to(device)
        y = torch.cat([b[1] for b in group]).to(device)
        loss = nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        if (step + 1) % accum == 0:
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}, norms


def _equivalence(accum, clip, wrap):
    acc = _accelerator(auto_wrap_policy=wrap, min_num_params=100)
    acc.gradient_accumulation_steps = accum
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 4 * accum
    norms, _ = _train(acc, model, opt, loader, steps, clip)
    ref, ref_norms = _reference(steps, accum, clip, 2, acc.num_processes, acc.device)
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
            out = model(x)
            assert out.dtype == torch.float32, out.dtype  # outputs come back in fp32, as with DDP
            loss = nn.functional.mse_loss(out, y)
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
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(acc.process_index)).to(acc.device)
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
    from hasten.files import unpickling

    # DCP's own reader (pickle.load) is never used; the allow-list reader once, for the check and the load.
    reads, pickled, read, read_pickled = [], [], unpickling.dcp_metadata, dcp.FileSystemReader.read_metadata
    unpickling.dcp_metadata = lambda path, *data: reads.append(1) or read(path, *data)
    dcp.FileSystemReader.read_metadata = lambda self, *a, **k: pickled.append(1) or read_pickled(self, *a, **k)
    try:
        acc.load_state(folder, continue_dataloaders=True)
    finally:
        unpickling.dcp_metadata, dcp.FileSystemReader.read_metadata = read, read_pickled
    at_save = {k: v.tolist() for k, v in _full(acc, model).items()}
    rest = _run(acc, model, opt, _batches(loader), 11)
    again = _full(acc, model)
    assert rest == whole[7:], (rest, whole[7:])
    assert all(torch.equal(final[k], again[k]) for k in final)
    import json

    with open(os.path.join(folder, "manifest.json")) as f:
        layout = json.load(f)["layout"]
    return {"layout": layout, "at_save": at_save, "saved_losses": whole[7:], "metadata_reads": len(reads),
            "pickle_reads": len(pickled)}


def check_ddp_checkpoint_into_fsdp():
    folder = os.path.join(os.environ["FSDP_TMP"], "ddp")
    acc, model, opt, loader = _setup(plugin=False)
    batches = _batches(loader)
    _run(acc, model, opt, batches, 5)
    acc.save_state(folder)
    expected = _full(acc, model)
    rest_ddp = _run(acc, model, opt, batches, 4)
    acc, model, opt, loader = _setup()
    acc.load_state(folder, continue_dataloaders=True)
    got = _full(acc, model)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    rest = _run(acc, model, opt, _batches(loader), 4)
    assert max(abs(a - b) for a, b in zip(rest, rest_ddp)) < 1e-5, (rest, rest_ddp)  # optimizer state came along
    return rest


def check_fsdp_checkpoint_into_ddp():
    folder = os.path.join(os.environ["FSDP_TMP"], "resume")  # written by check_bitwise_resume
    acc, model, opt, loader = _setup(plugin=False)
    acc.load_state(folder, continue_dataloaders=True)
    return _run(acc, model, opt, _batches(loader), 11)


def check_single_process_checkpoint_into_fsdp():
    folder = os.environ["FSDP_SINGLE_CKPT"]
    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2))
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=0.01))  # built on the sharded parameters
    acc.load_state(folder, continue_dataloaders=True)
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
        acc.load_state(folder, continue_dataloaders=True)
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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reset_state()
    acc = Accelerator()  # plain DDP setup; the user shards himself (torchtitan style)
    # on the ranks' device: fully_shard's default mesh is CUDA whenever a GPU exists, even for gloo ranks
    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, opt = acc.prepare(model, opt)
    assert prepared is model
    x = torch.randn(4, FEATURES, device=acc.device)
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
    # The streamed index is save_model's: each file's checksum and its own, verified by hasten's loader.
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["metadata"]["hasten_checksums"]) == {n for n in names if n.endswith(".safetensors")}
    from hasten import load_checkpoint_in_model

    plain = _model()
    load_checkpoint_in_model(plain, folder)
    assert all(torch.equal(plain.state_dict()[k], full[k].cpu()) for k in full)
    return names


def _fp16_setup():
    reset_state()
    from hasten.utils import GradScalerKwargs

    # A scale that these gradients fit in fp16, so only the forced overflows skip.
    acc = Accelerator(mixed_precision="fp16", fsdp_plugin=Plugin(fsdp_version=2),
                      kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.99)
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    return acc, *acc.prepare(model, opt, sched, loader)


def _fp16_step(acc, model, opt, sched, batches, poison=None):
    """One step; ``poison``: an overflow on process 1 only, in its batch or in its gradient shard."""
    x, y = next(batches)
    if poison == "batch" and acc.process_index == 1:
        x = x.clone()
        x[0, 0] = float("inf")
    before, lr = _full(acc, model), sched.get_last_lr()
    loss = nn.functional.mse_loss(model(x).float(), y)
    acc.backward(loss)
    if poison == "grad" and acc.process_index == 1:  # only this process's shard of the reduced gradient
        model[0].weight.grad.to_local()[0, 0] = float("inf")
    opt.step()
    sched.step()
    opt.zero_grad()
    after = _full(acc, model)
    return {"skipped": acc.optimizer_step_was_skipped, "changed": any(not torch.equal(before[k], after[k]) for k in after),
            "lr_moved": sched.get_last_lr() != lr, "scale": acc.scaler.get_scale(), "loss": float(loss)}


def check_fp16_overflow_on_one_process_skips_everywhere():
    """fp16 under FSDP2: an overflow on one process skips the step on every process (parameters and
    scheduler unchanged, scale backed off everywhere); the scaler's state saves and resumes; it trains."""
    folder = os.path.join(os.environ["FSDP_TMP"], "fp16")
    acc, model, opt, sched, loader = _fp16_setup()
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(acc.scaler, ShardedGradScaler), type(acc.scaler)
    batches = _batches(loader)
    steps = [_fp16_step(acc, model, opt, sched, batches, poison) for poison in (None, "batch", None, "grad", None)]
    assert [s["skipped"] for s in steps] == [False, True, False, True, False], steps
    assert [s["changed"] for s in steps] == [True, False, True, False, True], steps
    assert [s["lr_moved"] for s in steps] == [True, False, True, False, True], steps
    assert [s["scale"] for s in steps] == [1024.0, 512.0, 512.0, 256.0, 256.0], steps
    acc.save_state(folder)
    saved, saved_scaler = _full(acc, model), acc.scaler.state_dict()
    _fp16_step(acc, model, opt, sched, batches, "grad")  # moves the scale on after the save
    losses = [_fp16_step(acc, model, opt, sched, batches)["loss"] for _ in range(24)]  # 3 epochs: it trains
    assert sum(losses[-8:]) < sum(losses[:8]), losses
    assert all(p.dtype == torch.float32 for p in model.parameters())

    acc, model, opt, sched, loader = _fp16_setup()
    acc.load_state(folder, continue_dataloaders=True)
    assert acc.scaler.state_dict() == saved_scaler, (acc.scaler.state_dict(), saved_scaler)
    assert all(torch.equal(saved[k], v) for k, v in _full(acc, model).items())
    assert _fp16_step(acc, model, opt, sched, _batches(loader), "grad")["scale"] == saved_scaler["scale"] / 2
    return {"steps": steps, "scaler": saved_scaler}


def check_device_mesh_and_ranks():
    """``torch_device_mesh`` as Accelerate's: None without a parallelism_config; with dp_shard_size=2
    the dim ``dp_shard`` plus the flattened ``dp``, ``dp_shard_cp``, ``dp_cp``; FSDP2 shards over it."""
    from hasten.utils.parallelism_config import ParallelismConfig

    acc = _accelerator()
    assert acc.torch_device_mesh is None
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2), fsdp_plugin=Plugin(fsdp_version=2))
    facts = mesh_facts(acc)
    model = acc.prepare(_model())
    assert model[0].weight.device_mesh.mesh_dim_names == ("dp_shard",)
    return facts


def check_background_save_while_training_goes_on():
    """``save_state(blocking=False)`` under FSDP2: the shards are copied when it returns, so the steps
    taken while the background thread writes do not leak into the checkpoint; two saves in a row (host
    buffers reused), each loads bitwise and resumes with the same losses."""
    folders = [os.path.join(os.environ["FSDP_TMP"], f"background{i}") for i in range(2)]
    acc, model, opt, loader = _setup()
    batches = _batches(loader)
    saved, after = [], []
    for folder in folders:
        _run(acc, model, opt, batches, 3)
        acc.save_state(folder, blocking=False)
        saved.append(_full(acc, model))
        after.append(_run(acc, model, opt, batches, 3))  # while the save is written
    buffers = acc._checkpoints.background.stager.tree_buffers
    acc.wait_for_checkpoint()
    assert buffers and all(name.startswith("/model_0/") or name.startswith("/optimizer_0/") for name in buffers)
    for folder, weights, losses in zip(folders, saved, after):
        acc, model, opt, loader = _setup()
        acc.load_state(folder, continue_dataloaders=True)
        assert all(torch.equal(weights[k], v) for k, v in _full(acc, model).items())
        assert _run(acc, model, opt, _batches(loader), 3) == losses
    return sorted(os.listdir(os.path.join(folders[0], "sharded")))


def check_save_inside_accumulation_window_names_the_fix():
    acc = _accelerator()
    acc.gradient_accumulation_steps = 2
    model = _model()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     torch.utils.data.DataLoader(_data(), batch_size=2))
    x, y = next(iter(loader))
    with acc.accumulate(model):
        acc.backward(nn.functional.mse_loss(model(x), y))
    try:
        acc.save_state(os.path.join(os.environ["FSDP_TMP"], "mid_window"))
    except RuntimeError as e:  # every process's refusal, raised on every process
        assert "if accelerator.sync_gradients" in str(e), str(e)
        assert not os.path.exists(os.path.join(os.environ["FSDP_TMP"], "mid_window"))
        return str(e)
    raise AssertionError("saved inside an accumulation window")


def check_replicate_holds_full_parameters():
    """dp_replicate_size=2, dp_shard_size=1 under FSDP2: every process holds the full parameters (HSDP whose
    shard dimension is one process), trains like one process on twice the batch (as DDP does), and the
    checkpoint stores each tensor once, whole; it loads back exactly."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hasten.utils.parallelism_config import ParallelismConfig

    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2),
                      fsdp_plugin=Plugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100))
    assert acc.strategy.mesh.dp_size == 2 and acc.distributed_type == "FSDP"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=2))
    for name, p in model.named_parameters():
        assert p.to_local().shape == p.shape, (name, p.to_local().shape, p.shape)  # full, not half
        assert str(p.placements) == "(Replicate(), Shard(dim=0))", p.placements
        assert p.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard"), p.device_mesh
    norms, _ = _train(acc, model, opt, loader, 4, clip=0.05)
    ref, ref_norms = _reference(4, 1, 0.05, 2, 2, acc.device)
    got = _full(acc, model)
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-5, worst
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) < 1e-5, (norms, ref_norms)

    folder = os.path.join(os.environ["FSDP_TMP"], "replicate")
    acc.save_state(folder)
    saved = _full(acc, model)
    _train(acc, model, opt, loader, 2)
    acc.load_state(folder, continue_dataloaders=True)
    assert all(torch.equal(saved[k], v) for k, v in _full(acc, model).items())
    meta = dcp.FileSystemReader(os.path.join(folder, "sharded")).read_metadata()
    chunks = {k: [list(c.sizes) for c in v.chunks] for k, v in meta.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata) and k.startswith("model_0.")}
    assert chunks and all(sizes == [list(saved[k[len("model_0."):]].shape)] for k, sizes in chunks.items()), chunks
    return {"worst": worst, "chunks": len(chunks)}


class _Normed(nn.Module):
    """A layer with a persistent and a non-persistent buffer (both must reach every process)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(FEATURES, 1)
        self.register_buffer("shift", torch.arange(FEATURES, dtype=torch.float32) / 10)
        self.register_buffer("scale", torch.full((1,), 0.5), persistent=False)

    def forward(self, x):
        return self.lin(x - self.shift) * self.scale


def _buffered_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, FEATURES), _Normed())
    with torch.no_grad():
        model[3].shift.add_(1.0)  # values no fresh build has: they must come from process 0
        model[3].scale.fill_(2.0)
    return model


def check_cpu_ram_efficient_loading_with_offload():
    """Process 0's weights reach a process that built on meta, into CPU shards (offload), buffers on the
    device; training then runs."""
    from hasten import init_empty_weights

    reset_state()
    acc = Accelerator(fsdp_plugin=Plugin(fsdp_version=2, cpu_ram_efficient_loading=True, cpu_offload=True,
                                         auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100))
    if acc.is_main_process:
        model = _buffered_model()
    else:
        with init_empty_weights(include_buffers=True):
            model = _buffered_model()
        assert all(p.is_meta for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    expected = _buffered_model()
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())  # cpu-on-purpose: offloaded shards live on the CPU
    for name, p in model.named_parameters():
        mine = p.to_local()
        full = expected.get_parameter(name)
        start = acc.process_index * ((full.shape[0] + 1) // 2)
        assert torch.equal(mine, full[start:start + mine.shape[0]]), name  # this process's rows of rank 0's
    for name, b in model.named_buffers():
        assert b.device == acc.device and torch.equal(b.cpu(), expected.get_buffer(name)), name
    got = _full(acc, model)
    assert all(torch.equal(got[k], v) for k, v in expected.state_dict().items())
    x = torch.randn(4, FEATURES, device=acc.device)
    acc.backward(model(x).pow(2).mean())
    acc.clip_grad_norm_(model.parameters(), 1.0)  # its total is a CPU tensor under offload
    opt.step()
    from safetensors.torch import load_file

    folder = os.path.join(os.environ["FSDP_TMP"], "offload_weights")
    acc.save_model(model, folder)  # full_tensor() of CPU shards
    acc.wait_for_everyone()
    trained = _full(acc, model)
    written = load_file(os.path.join(folder, "model.safetensors"))
    assert set(written) == set(trained) and all(torch.equal(written[k], trained[k]) for k in trained)
    return sorted(got)


def check_tampered_or_damaged_shards_are_refused():
    """A checkpoint whose ``sharded/.metadata`` was replaced by a pickle that opens a file: every process
    refuses it, naming the file and the global, before anything in it runs and before anything changes.
    Sharded files carry checksums, so ``verify="checksum"`` finds a flipped byte in a shard; the real
    checkpoints (blocking and background saves) still load that way."""
    import json
    import shutil

    from distributed import evil_pickle, refused_load, tamper
    from hasten.files.errors import CheckpointCorruptError

    root = os.environ["FSDP_TMP"]
    source = os.path.join(root, "resume")  # written by check_bitwise_resume
    evil, flipped = os.path.join(root, "evil"), os.path.join(root, "flipped")
    marker = os.path.join(root, "created_by_a_pickle")
    acc, model, opt, loader = _setup()
    if acc.is_main_process:
        shutil.copytree(source, evil)
        tamper(evil, "sharded/.metadata", evil_pickle(marker))
        shutil.copytree(source, flipped)
        with open(os.path.join(flipped, "sharded", "__1_0.distcp"), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    acc.wait_for_everyone()
    before = _full(acc, model)
    message = refused_load(acc, evil, marker)
    assert os.path.join("evil", "sharded", ".metadata") in message and "io.open" in message, message
    assert "tampered" in message and "nothing was changed" in message, message
    assert all(torch.equal(before[k], v) for k, v in _full(acc, model).items())

    with open(os.path.join(source, "manifest.json")) as f:
        files = json.load(f)["files"]
    shards = {n: info["checksum"] for n, info in files.items() if n.startswith("sharded/")}
    assert sorted(shards) == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"], shards
    assert all(shards.values()), shards
    try:
        acc.load_state(flipped, verify="checksum")
    except CheckpointCorruptError as e:
        corrupt = str(e)
    else:
        raise AssertionError("a shard with a flipped byte passed verify='checksum'")
    assert "__1_0.distcp" in corrupt and "checksum" in corrupt, corrupt
    for folder in (source, os.path.join(root, "background0")):
        acc, model, opt, loader = _setup()
        acc.load_state(folder, verify="checksum")
    return {"refused": message, "corrupt": corrupt}
