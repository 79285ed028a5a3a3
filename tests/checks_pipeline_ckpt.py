"""Checkpoints under pipeline parallelism on real gloo processes (see distributed.py and
test_pipeline_ckpt.py): save_state/load_state at pp_size=2 (DCP shards under the original parameter
names), a one-process checkpoint loaded at pp_size=2, and load_checkpoint_in_model into the stages.

Every check runs on 2 processes (pp_size=2, GPipe, 2 microbatches) with ``PPCK_TMP`` shared with the test.
"""

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from checks_pipeline import _gather  # every rank's {name: tensor} merged
from distributed import reset_state
from hasten import Accelerator
from hasten.pipeline import pipeline_loss
from hasten.utils.parallelism_config import ParallelismConfig

WIDTH, SAMPLES, BATCH = 8, 48, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    return torch.utils.data.TensorDataset(x, x.sin())


def _loader():
    return torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=True)


def _groups(model):
    """Two parameter groups (biases without weight decay): groups are mapped back by name."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 5e-3}]


def _setup(schedule: str = "GPipe", microbatches: int = 2, groups: bool = False):
    reset_state()
    # the default scheduler rule: under pp_size=2 on 2 processes one batch per step, so one scheduler step, as
    # on one process
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule=schedule,
                                                           pp_microbatches=microbatches))
    model = pipeline_loss(_model(), nn.functional.mse_loss)
    opt = torch.optim.AdamW(_groups(model) if groups else model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, loader, sched = acc.prepare(model, opt, _loader(), sched)
    return acc, model, opt, loader, sched


def _run(acc, model, opt, sched, batches, steps, folder=None, save_at=None):
    losses = []
    for i in range(steps):
        x, y = next(batches)
        out = model(x, labels=y)
        acc.backward(out.loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(out.loss))
        if save_at is not None and i + 1 == save_at:
            acc.save_state(folder)
    return losses


def _params(model) -> dict:
    return _gather(dict(model.named_stage_parameters()))


def _moments(model, opt) -> dict:
    """The optimizer state of every stage, ``{name.key: tensor}`` under the original names."""
    names = {id(p): n for n, p in model.named_stage_parameters()}
    return _gather({f"{names[id(p)]}.{k}": v for p, s in opt.state.items() for k, v in s.items()
                    if isinstance(v, torch.Tensor)})


def _lists(d: dict) -> dict:
    return {k: v.tolist() for k, v in d.items()}


def check_mid_epoch_resume():
    folder = os.path.join(os.environ["PPCK_TMP"], "resume")
    acc, model, opt, loader, sched = _setup()
    whole = _run(acc, model, opt, sched, iter(loader), 6, folder, save_at=3)
    final = _params(model)
    acc, model, opt, loader, sched = _setup()
    acc.load_state(folder, continue_dataloaders=True)
    at_save, moments = _params(model), _moments(model, opt)
    lr = opt.param_groups[0]["lr"]
    rest = _run(acc, model, opt, sched, iter(loader), 3)
    again = _params(model)
    assert rest == whole[3:], (rest, whole[3:])
    assert all(torch.equal(final[k], again[k]) for k in final)
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    return {"layout": manifest["layout"], "at_save": _lists(at_save), "moments": _lists(moments), "lr": lr,
            "saved_losses": whole[3:], "files": sorted(manifest["files"])}


def check_single_process_checkpoint_into_pp():
    folder = os.environ["PPCK_SINGLE"]
    with open(os.path.join(os.environ["PPCK_TMP"], "single.json")) as f:
        expected = json.load(f)
    acc, model, opt, loader, sched = _setup()
    acc.load_state(folder, continue_dataloaders=True)
    params, moments = _params(model), _moments(model, opt)
    assert set(params) == set(expected["params"]) and set(moments) == set(expected["moments"])
    assert all(torch.equal(params[k], torch.tensor(v)) for k, v in expected["params"].items())
    assert all(torch.equal(moments[k], torch.tensor(v)) for k, v in expected["moments"].items())
    rest = _run(acc, model, opt, sched, iter(loader), 2)
    assert max(abs(a - b) for a, b in zip(rest, expected["rest"])) < 1e-6, (rest, expected["rest"])
    return rest


def check_load_checkpoint_in_model():
    from safetensors.torch import save_file

    from hasten.model_loading import load_checkpoint_in_model

    torch.manual_seed(5)
    other = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
    path = os.path.join(os.environ["PPCK_TMP"], "weights.safetensors")
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in other.state_dict().items()}, path)
    dist.barrier()
    acc, model, opt, loader, sched = _setup()
    result = load_checkpoint_in_model(model, path, strict=True)  # the other stages' tensors are not unexpected
    assert list(result[0]) == [] and list(result[1]) == [], result
    mine = dict(model.named_stage_parameters())
    assert mine and all(torch.equal(p.detach().cpu(), other.state_dict()[k]) for k, p in mine.items())
    # two stages on each process (0, 2 | 1, 3): both filled, from one pass over the file
    acc, model, opt, loader, sched = _setup("Interleaved1F1B", 4)
    ids = {id(p) for p in model.parameters()}
    result = load_checkpoint_in_model(model, path, strict=True)
    assert list(result[0]) == [] and list(result[1]) == [], result
    assert {id(p) for p in model.parameters()} == ids  # in place: the optimizer's parameters
    two = dict(model.named_stage_parameters())
    assert len(two) == 4 and all(torch.equal(p.detach().cpu(), other.state_dict()[k]) for k, p in two.items())
    # strict and a key of stage 3 (process 1's second stage) missing: process 1 raises, its stage 1 unchanged
    from hasten.saving import CheckpointMismatchError

    lacking = os.path.join(os.environ["PPCK_TMP"], "lacking.safetensors")
    if dist.get_rank() == 0:
        torch.manual_seed(6)
        save_file({k: torch.randn(v.shape) for k, v in other.state_dict().items() if k != "3.0.weight"}, lacking)
    dist.barrier()
    before = {k: v.detach().clone() for k, v in model.named_stage_parameters()}
    try:
        load_checkpoint_in_model(model, lacking, strict=True)
    except CheckpointMismatchError as e:
        assert dist.get_rank() == 1 and "3.0.weight" in str(e), str(e)
        assert all(torch.equal(p, before[k]) for k, p in model.named_stage_parameters())
    else:
        assert dist.get_rank() == 0
    try:
        load_checkpoint_in_model(model, path, dtype=torch.float64)
    except ValueError as e:
        assert "dtype" in str(e)
    else:
        raise AssertionError("a dtype for a prepared pipeline was accepted")
    return sorted(mine)


def check_pp_checkpoint_into_fsdp2():
    """The pp_size=2 checkpoint of check_mid_epoch_resume read by FSDP2 over the same 2 processes
    (DCP reshards): the same parameters and Adam state, gathered in full."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    folder = os.path.join(os.environ["PPCK_TMP"], "resume")
    reset_state()
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), step_scheduler_with_optimizer=False)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    assert type(acc.strategy).__name__ == "FSDP2Strategy"
    acc.load_state(folder)
    params = {k: v.detach().cpu() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}
    full = get_optimizer_state_dict(model, getattr(opt, "optimizer", opt),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    moments = {f"{n}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
               for n, s in full["state"].items() for k, v in s.items()}
    return {"params": _lists(params), "moments": _lists(moments), "lr": opt.param_groups[0]["lr"]}


def check_interleaved_two_groups_resume():
    """Interleaved1F1B (two stages per process: 0, 2 and 1, 3) and an optimizer with two parameter
    groups: the mid-epoch resume is exact, and a blocking=False save gives the same checkpoint."""
    folder = os.path.join(os.environ["PPCK_TMP"], "interleaved")
    acc, model, opt, loader, sched = _setup("Interleaved1F1B", 4, groups=True)
    assert [s for s, _ in model.local_stages()] == [dist.get_rank(), dist.get_rank() + 2]
    batches = iter(loader)
    first = _run(acc, model, opt, sched, batches, 3)
    acc.save_state(folder, blocking=False)  # staged copies, written in the background
    whole = first + _run(acc, model, opt, sched, batches, 3)
    acc.wait_for_checkpoint()
    final = _params(model)
    acc, model, opt, loader, sched = _setup("Interleaved1F1B", 4, groups=True)
    acc.load_state(folder, continue_dataloaders=True)
    lrs = [g["lr"] for g in opt.param_groups]
    decay = [g["weight_decay"] for g in opt.param_groups]
    rest = _run(acc, model, opt, sched, iter(loader), 3)
    again = _params(model)
    assert rest == whole[3:], (rest, whole[3:])
    assert all(torch.equal(final[k], again[k]) for k in final)
    return {"lrs": lrs, "decay": decay, "sizes": [len(g["params"]) for g in opt.param_groups]}


def check_save_inside_accumulation_window_is_refused():
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=2,
                      parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="GPipe", pp_microbatches=2))
    model = pipeline_loss(_model(), nn.functional.mse_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, _loader())
    x, y = next(iter(loader))
    with acc.accumulate(model):
        acc.backward(model(x, labels=y).loss)
    assert not acc.sync_gradients
    folder = os.path.join(os.environ["PPCK_TMP"], "window")
    try:
        acc.save_state(folder)
    except RuntimeError as e:  # every process raises every process's ValueError; nothing committed
        message = str(e)
    else:
        raise AssertionError("save_state inside an accumulation window was accepted")
    return {"message": message, "written": os.path.exists(os.path.join(folder, "manifest.json"))}


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def check_llama_load_checkpoint_in_model():
    """A Llama's weights folder (model.safetensors of another seed, written by process 0) into a prepared 2-stage
    pipeline: every stage equals the saved weights, and the pipelined loss equals the saved model's."""
    from hasten.model_loading import load_checkpoint_in_model

    folder = os.path.join(os.environ["PPCK_TMP"], "llama_weights")
    source = _llama(7)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in source.state_dict().items()},
                  os.path.join(folder, "model.safetensors"))
    dist.barrier()
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="GPipe", pp_microbatches=2))
    model = acc.prepare(_llama(0))
    missing, unexpected = load_checkpoint_in_model(model, folder, strict=True)
    assert list(missing) == [] and list(unexpected) == []
    expected = source.state_dict()
    mine = model.stage_state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in mine.items())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
        ref = float(source(input_ids=ids, labels=ids).loss)
    assert abs(loss - ref) < 1e-5, (loss, ref)
    return sorted(mine)


def check_gpipe_checkpoint_into_interleaved():
    """The GPipe checkpoint of check_mid_epoch_resume (stages 0 | 1, two blocks each) read by an
    Interleaved1F1B run (stages 0, 2 | 1, 3): another cut of the same model, same names."""
    acc, model, opt, loader, sched = _setup("Interleaved1F1B", 4)
    acc.load_state(os.path.join(os.environ["PPCK_TMP"], "resume"))
    return {"params": _lists(_params(model)), "moments": _lists(_moments(model, opt)),
            "lr": opt.param_groups[0]["lr"]}


def check_checkpoint_of_another_model_changes_nothing():
    """A pp_size=2 checkpoint read into a pipeline of another shape: every process raises, naming the
    difference, before any parameter or optimizer state changed."""
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="GPipe", pp_microbatches=2))
    torch.manual_seed(0)
    widths = [WIDTH, WIDTH + 2, WIDTH, WIDTH, WIDTH]  # blocks 0 and 1 (process 0's stage) differ
    model = nn.Sequential(*[nn.Sequential(nn.Linear(widths[i], widths[i + 1]), nn.Tanh()) for i in range(4)])
    pipeline_loss(model, nn.functional.mse_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, loader, sched = acc.prepare(model, opt, _loader(), sched)
    before = {k: v.clone() for k, v in model.stage_state_dict().items()}
    try:
        acc.load_state(os.path.join(os.environ["PPCK_TMP"], "resume"))
    except Exception as e:  # noqa: BLE001
        message = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("a checkpoint of another model was loaded")
    assert all(torch.equal(v, before[k]) for k, v in model.stage_state_dict().items())
    assert not opt.state
    return message


def check_pp_times_dp_resume():
    """4 processes: pp_size=2 x dp_replicate_size=2 (run alone, by test_pipeline_ckpt's ``four``). Both
    replicas hold every stage's keys (DCP stores each once); the mid-epoch resume is bitwise exact."""
    if dist.get_world_size() != 4:
        return "skipped"
    folder = os.path.join(os.environ["PPCK_TMP"], "pp_dp")

    def setup():
        reset_state()
        acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_schedule="GPipe",
                                                               pp_microbatches=2))
        model = pipeline_loss(_model(), nn.functional.mse_loss)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return (acc, *acc.prepare(model, opt, _loader(), sched))

    acc, model, opt, loader, sched = setup()
    whole = _run(acc, model, opt, sched, iter(loader), 6, folder, save_at=3)
    final = {k: v.detach().clone() for k, v in model.stage_state_dict().items()}
    acc, model, opt, loader, sched = setup()
    acc.load_state(folder, continue_dataloaders=True)
    rest = _run(acc, model, opt, sched, iter(loader), 3)
    assert rest == whole[3:], (rest, whole[3:])
    assert all(torch.equal(v, final[k]) for k, v in model.stage_state_dict().items())
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    return {"layout": manifest["layout"], "files": sorted(n for n in manifest["files"] if n.startswith("sharded/"))}


def check_meta_built_llama_fills_from_weights_and_trains():
    """A Llama built under init_empty_weights() on every process (no process ever holds the whole model): prepare
    gives this process's stages storage; a step before any load is refused on every process (none left waiting);
    load_checkpoint_in_model fills each stage; then a training step, with an optimizer built on the meta
    parameters, equals the real model's on one process."""
    from hasten import init_empty_weights
    from hasten.model_loading import load_checkpoint_in_model

    folder = os.path.join(os.environ["PPCK_TMP"], "llama_meta_weights")
    source = _llama(11)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, os.path.join(folder, "model.safetensors"))
    dist.barrier()
    reset_state()
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B", pp_microbatches=2))
    with init_empty_weights():
        empty = _llama(0)
    assert all(p.is_meta for p in empty.parameters())
    opt = torch.optim.SGD(empty.parameters(), lr=0.5)
    model, opt = acc.prepare(empty, opt)
    held = [p for _, p in model.named_stage_parameters()]
    assert held and not any(p.is_meta for p in held)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    try:
        model(input_ids=ids, labels=ids)
    except ValueError as error:
        refused = str(error)
    else:
        raise AssertionError("a step on weights that were never loaded was accepted")
    load_checkpoint_in_model(model, folder, strict=True)
    out = model(input_ids=ids, labels=ids)
    acc.backward(out.loss)
    opt.step()
    ref_opt = torch.optim.SGD(source.parameters(), lr=0.5)
    ref_loss = source(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_opt.step()
    expected = source.state_dict()
    worst = max(float((v - expected[k]).abs().max()) for k, v in model.stage_state_dict().items())
    assert abs(float(out.loss) - float(ref_loss)) < 1e-5 and worst < 1e-5, (float(out.loss), float(ref_loss), worst)
    return {"refused": refused, "worst": worst, "held": len(held)}
