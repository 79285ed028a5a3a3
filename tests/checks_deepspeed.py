"""DeepSpeed ZeRO inside each rank (see distributed.py and test_deepspeed.py): equivalence with DDP on
2 processes, bf16, a JSON with "auto" values, DummyOptim/DummyScheduler, exact resume, save_model,
bad input."""

import json
import os

import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator
from hasten.utils import set_seed
from hasten.utils.deepspeed import DummyOptim, DummyScheduler
from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

# The model, data, loop and DDP reference of the FSDP checks: the same numbers judge both strategies.
from checks_fsdp import _data, _model, _reference, _train  # noqa: E402


def _accelerator(accum=1, mixed_precision=None, **plugin) -> Accelerator:
    reset_state()
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(**plugin), gradient_accumulation_steps=accum,
                       mixed_precision=mixed_precision)


def _equivalence(stage, accum, clip):
    acc = _accelerator(accum, zero_stage=stage, gradient_clipping=clip)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert type(model).__name__ == "DeepSpeedEngine" and acc.unwrap_model(model) is model.module
    steps = 4 * accum
    from hasten import progress

    stepped = progress.STATE.steps
    norms, _ = _train(acc, model, opt, loader, steps, clip)
    # The hang watchdog's step counter moves once per real (engine) step, as with DDP.
    assert progress.STATE.steps - stepped == 4, progress.STATE.steps - stepped
    ref, ref_norms = _reference(steps, accum, clip, 2, acc.num_processes, acc.device)  # weights on CPU
    got = acc.get_state_dict(model)
    worst = max(float((got[k].cpu() - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-5, worst
    assert len(norms) == len(ref_norms) == 4 and all(abs(a - b) < 1e-5 for a, b in zip(norms, ref_norms)), \
        (norms, ref_norms)
    return {"worst": worst, "norms": norms}


def check_zero1_equals_ddp():
    return _equivalence(1, 1, 0.05)


def check_zero2_equals_ddp_accumulation():
    return _equivalence(2, 2, 0.05)


def check_zero3_equals_ddp_accumulation():
    return _equivalence(3, 2, 0.05)


def check_zero3_equals_ddp():
    return _equivalence(3, 1, 0.05)


def check_bf16_trains():
    acc = _accelerator(mixed_precision="bf16", zero_stage=2, gradient_clipping=1.0)
    model = nn.Sequential(nn.Embedding(8, 16), nn.Flatten(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 8, (32, 2), generator=g)
    y = (ids.float().sum(1, keepdim=True) / 8).sin()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, y), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert acc.unwrap_model(model)[2].weight.dtype == torch.bfloat16
    losses = []
    for _ in range(8):
        for x, t in loader:
            loss = nn.functional.mse_loss(model(x).float(), t)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    assert sum(losses[-4:]) < sum(losses[:4]), losses
    return losses[0], losses[-1]


def check_json_auto_values_and_dummies():
    """A JSON of the kind users keep: "auto" everywhere, optimizer and scheduler sections."""
    path = os.path.join(os.environ["HASTEN_TEST_TMP"], "ds.json")
    if int(os.environ["RANK"]) == 0:
        config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                  "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                            "betas": "auto", "eps": "auto"}},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                               "warmup_num_steps": "auto"}},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}
        with open(path + ".tmp", "w") as f:
            json.dump(config, f)
        os.replace(path + ".tmp", path)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    reset_state()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=path, gradient_clipping=0.5),
                      gradient_accumulation_steps=2)
    model = _model()
    opt = DummyOptim(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = DummyScheduler(opt, warmup_num_steps=4)
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    cfg = acc.strategy.config
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["train_batch_size"] == 4 * 2 * acc.num_processes
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"]["enabled"] is False and cfg["scheduler"]["params"]["warmup_max_lr"] == 0.02
    assert isinstance(opt.optimizer, torch.optim.AdamW) and opt.optimizer.defaults["weight_decay"] == 0.01
    lrs = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[-1] > lrs[0] and max(lrs) <= 0.02 + 1e-12, lrs  # warming up towards the optimizer's lr
    return lrs


class Progress:
    """Training steps done, stored in the checkpoint (register_for_checkpointing)."""

    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def _resume_run(folder, stage, accum, save_at=None):
    """Two epochs of shuffled data with noise from the global RNG; saves at ``save_at`` or resumes from ``folder``."""
    set_seed(5)
    acc = _accelerator(accum, zero_stage=stage, gradient_clipping=1.0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(_data(), batch_size=2, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    if save_at is None:
        acc.load_state(folder, continue_dataloaders=True)
    losses = {}
    for _ in range(loader.iteration, 2):
        for x, y in loader:
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x) + 0.01 * torch.randn_like(y), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            progress.steps += 1
            losses[progress.steps] = float(loss)
            if progress.steps == save_at:
                acc.save_state(folder)
    return losses, acc.get_state_dict(model)


def _exact_resume(name, stage, accum, save_at):
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], name)
    full, weights = _resume_run(folder, stage, accum, save_at)
    resumed, weights2 = _resume_run(folder, stage, accum)
    assert min(resumed) == save_at + 1 and all(full[k] == v for k, v in resumed.items()), (full, resumed)
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
    return len(resumed)


def check_exact_resume_zero3():
    return _exact_resume("resume3", 3, 1, 3)


def check_exact_resume_zero2_accumulation():
    return _exact_resume("resume2", 2, 2, 4)


def check_save_model_every_rank():
    acc = _accelerator(zero_stage=3, gradient_clipping=1.0)
    model, opt, _ = _prepared(acc)
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "saved3")
    acc.save_model(model, folder)  # every rank calls it: the gather is collective
    acc.wait_for_everyone()
    from safetensors.torch import load_file

    loaded = load_file(os.path.join(folder, "model.safetensors"))
    expected = _model().state_dict()
    assert set(loaded) == set(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
    return sorted(loaded)


def check_transformers_zero3_save_model_reloads():
    from transformers import LlamaConfig, LlamaForCausalLM

    acc = _accelerator(zero_stage=3, gradient_clipping=1.0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    for (x,) in loader:
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "llama3")
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        acc.unwrap_model(model).config.save_pretrained(folder)
    acc.save_model(model, folder)
    acc.wait_for_everyone()
    again = LlamaForCausalLM.from_pretrained(folder)
    mine = again.state_dict()
    worst = max(float((mine[k] - state[k].cpu()).abs().max()) for k in state if k in mine)
    assert worst == 0.0, worst
    return worst


def check_zero3_init_flag_builds_partitioned_models():
    from transformers import AutoModelForCausalLM, LlamaConfig

    acc = _accelerator(zero_stage=3, zero3_init_flag=True, gradient_clipping=1.0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(cfg)
    weight = model.model.embed_tokens.weight
    assert weight.numel() == 0 and tuple(weight.ds_shape) == (64, 32)  # never materialised whole
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    losses = []
    for _ in range(3):
        for (x,) in loader:
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    return losses


def check_bad_inputs():
    messages = {}

    def expect(name, fn, *words):
        try:
            fn()
        except (ValueError, TypeError) as e:
            text = str(e)
            assert all(w in text for w in words), (name, text)
            messages[name] = text
            return
        raise AssertionError(f"{name}: no error")

    expect("stage", lambda: DeepSpeedPlugin(zero_stage=5), "stage=5")
    expect("offload_param", lambda: DeepSpeedPlugin(zero_stage=2, offload_param_device="cpu"), "zero_stage=3")
    expect("json_missing", lambda: DeepSpeedPlugin(hf_ds_config="/nonexistent.json"), "/nonexistent.json")
    expect("no_zero_section", lambda: DeepSpeedPlugin(hf_ds_config={"train_batch_size": 8}), "zero_optimization")
    expect("plugin_vs_json", lambda: DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}}, zero_stage=3),
           "zero_optimization.stage=1", "3")

    acc = _accelerator(zero_stage=2, gradient_clipping=1.0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expect("optimizer_alone", lambda: acc.prepare(opt), "accelerator.prepare(model, optimizer")
    expect("no_loader", lambda: acc.prepare(model, opt), "train_micro_batch_size_per_gpu")

    reset_state()
    expect("accum_contradiction", lambda: Accelerator(deepspeed_plugin=DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}),
        gradient_accumulation_steps=2), "gradient_accumulation_steps=4", "2")
    reset_state()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2},
                                                                     "bf16": {"enabled": True}}))
    loader = torch.utils.data.DataLoader(_data(), batch_size=2)
    expect("precision_contradiction", lambda: _prepared(acc), "bf16.enabled=True", "mixed_precision='no'")
    acc = _accelerator(zero_stage=2, gradient_clipping=1.0)
    m = _model()
    expect("real_optimizer_with_section", lambda: _section_clash(acc, m), "optimizer", "DummyOptim")
    acc = _accelerator(zero_stage=2, gradient_clipping=1.0)
    model, opt, loader = _prepared(acc)
    x, y = next(iter(loader))
    acc.backward(nn.functional.mse_loss(model(x), y))
    expect("clip_mismatch", lambda: acc.clip_grad_norm_(model.parameters(), 0.3), "max_norm=0.3",
           "gradient_clipping=1.0")
    expect("clip_value", lambda: acc.clip_grad_value_(model.parameters(), 0.3), "clip_grad_norm_")
    two = _model()
    expect("second_engine", lambda: acc.prepare(two, torch.optim.SGD(two.parameters(), lr=1)), "one model")
    acc.free_memory()  # then a new model trains in the same Accelerator
    assert acc.strategy.engines == [] and acc._models == []
    _prepared(acc)
    return messages


def _prepared(acc):
    m = _model()
    return acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.utils.data.DataLoader(_data(), batch_size=2))


def _section_clash(acc, m):
    acc.strategy.plugin.deepspeed_config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.1}}
    try:
        acc.prepare(m, torch.optim.SGD(m.parameters(), lr=1), torch.utils.data.DataLoader(_data(), batch_size=2))
    finally:
        acc.strategy.plugin.deepspeed_config.pop("optimizer")


def _trained(stage, folder=None, steps=3, optimizer=torch.optim.AdamW):
    """A model trained ``steps`` steps under ZeRO ``stage`` on this run's processes, saved to ``folder``."""
    acc = _accelerator(zero_stage=stage, gradient_clipping=1.0)
    m = _model()
    model, opt, loader = acc.prepare(m, optimizer(m.parameters(), lr=0.01),
                                     torch.utils.data.DataLoader(_data(), batch_size=2))
    for _, (x, y) in zip(range(steps), loader):
        acc.backward(nn.functional.mse_loss(model(x), y))
    if folder is not None:
        acc.save_state(folder)
    return acc, model


def _save_reference(acc, model, path):
    from safetensors.torch import save_file

    state = acc.get_state_dict(model)
    if acc.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    acc.wait_for_everyone()
    return state


def check_zero_checkpoints_for_merge_weights():
    """ZeRO 0-3 checkpoints (and each model's get_state_dict) for the merge-weights tests, written by 2 processes;
    the ZeRO-1 one is then loaded by ZeRO-3 on the same processes (another stage: consolidated weights)."""
    root = os.environ["HASTEN_TEST_TMP"]
    for stage in (0, 1, 2, 3):
        acc, model = _trained(stage, os.path.join(root, f"zero{stage}"))
        _save_reference(acc, model, os.path.join(root, f"zero{stage}.safetensors"))
        acc.free_memory()
    from safetensors.torch import load_file

    acc, model = _trained(3, steps=1)
    with _Warnings() as caught:
        acc.load_state(os.path.join(root, "zero1"), continue_dataloaders=True)
    got, expected = acc.get_state_dict(model), load_file(os.path.join(root, "zero1.safetensors"))
    assert all(torch.equal(got[k].cpu(), expected[k]) for k in expected)
    assert any("ZeRO stage 1 on 2 processes" in w and "optimizers start fresh" in w for w in caught), caught
    return root


class _Warnings:
    """Collect the messages of warnings raised inside (the checks run without pytest's fixtures)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self._records = self._ctx.__enter__()
        warnings.simplefilter("always")
        self.messages = []
        return self.messages

    def __exit__(self, *exc):
        self.messages.extend(str(w.message) for w in self._records)
        return self._ctx.__exit__(*exc)


def check_resume_on_other_world_size():
    """Written by this 2-process run for check_load_on_one_process (run alone afterwards)."""
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "for_one")
    acc, model = _trained(2, folder, optimizer=torch.optim.SGD)
    _save_reference(acc, model, folder + ".safetensors")
    return folder


def _one_sgd_step(acc, model, opt, x, y):
    """One plain SGD step (fresh optimizer, the saved lr 0.01) from the model's current weights: what a run must
    produce."""
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]  # the saved lr, not the constructor's 0.1
    start = {k: v.clone().requires_grad_(True) for k, v in acc.get_state_dict(model).items()}
    out = torch.func.functional_call(_model(), start, (x,))
    grads = torch.autograd.grad(nn.functional.mse_loss(out, y), list(start.values()))
    expected = {k: (v - 0.01 * g).detach() for (k, v), g in zip(start.items(), grads)}
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    got = acc.get_state_dict(model)
    return max(float((got[k] - expected[k]).abs().max()) for k in expected)


def check_load_on_one_process():
    """Run alone (world_size=1, DS_FOLDER set): the 2-process ZeRO-2 checkpoint loads as consolidated weights into
    ZeRO 2 and 3 and a plain process, trains on from them, and is saved again for 2 processes (ZeRO-3)."""
    folder = os.environ.get("DS_FOLDER")
    if folder is None:
        return "skipped"
    from safetensors.torch import load_file

    expected = load_file(folder + ".safetensors")
    worst, messages = {}, {}
    # gradient_clipping=0: the next step is compared with a plain unclipped one (the default, "auto", clips at 1.0).
    for name, plugin in (("zero2", {"zero_stage": 2, "gradient_clipping": 0.0}),
                         ("zero3", {"zero_stage": 3, "gradient_clipping": 0.0}), ("plain", None)):
        reset_state()
        acc = (Accelerator() if plugin is None else
               Accelerator(deepspeed_plugin=DeepSpeedPlugin(**plugin)))
        model, opt, loader = _prepared(acc)
        with _Warnings() as caught:
            acc.load_state(folder, continue_dataloaders=True)
        got = acc.get_state_dict(model)
        assert sorted(got) == sorted(expected) and all(torch.equal(got[k].cpu(), expected[k]) for k in expected), name
        messages[name] = [m for m in caught if "optimizers start fresh" in m]
        assert messages[name] and "ZeRO stage 2 on 2 processes" in messages[name][0], caught
        x, y = next(iter(loader))
        worst[name] = _one_sgd_step(acc, model, opt, x, y)  # the fp32 masters hold the loaded weights
        assert worst[name] < 1e-6, worst
        if name == "zero3":
            again = os.path.join(os.path.dirname(folder), "from_one")
            acc.save_state(again)
            _save_reference(acc, model, again + ".safetensors")
        if name == "plain":
            acc.save_state(os.path.join(os.path.dirname(folder), "plain"))
        acc.free_memory()
    # A DeepSpeed run loads only engine checkpoints: a plain one is refused before anything changes.
    acc = _accelerator(zero_stage=2)
    model, _, _ = _prepared(acc)
    try:
        acc.load_state(os.path.join(os.path.dirname(folder), "plain"), continue_dataloaders=True)
    except Exception as e:  # noqa: BLE001
        assert "written without DeepSpeed and this run uses DeepSpeed" in str(e), str(e)
    else:
        raise AssertionError("a plain checkpoint loaded into a DeepSpeed run")
    assert all(torch.equal(v.cpu(), _model().state_dict()[k]) for k, v in acc.get_state_dict(model).items())
    # A model the weights do not fit: refused before anything changes, naming both layouts.
    acc = _accelerator(zero_stage=2, gradient_clipping=1.0)
    wide = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 1))
    model, _, _ = acc.prepare(wide, torch.optim.SGD(wide.parameters(), lr=0.1),
                              torch.utils.data.DataLoader(_data(), batch_size=2))
    before = acc.get_state_dict(model)
    try:
        acc.load_state(folder, continue_dataloaders=True)
    except Exception as e:  # noqa: BLE001 - the message is what the test judges
        refused = str(e)
    else:
        raise AssertionError("a checkpoint of other shapes loaded")
    after = acc.get_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    return {"worst": worst, "warning": messages["zero2"][0], "refused": refused}


def check_load_back_on_two_processes():
    """Run with DS_FOLDER: the checkpoint saved by 1 process (ZeRO-3) loads on 2 (ZeRO-2)."""
    folder = os.environ.get("DS_FOLDER")
    if folder is None:
        return "skipped"
    from safetensors.torch import load_file

    acc = _accelerator(zero_stage=2, gradient_clipping=1.0)
    model, opt, loader = _prepared(acc)
    with _Warnings() as caught:
        acc.load_state(folder, continue_dataloaders=True)
    got, expected = acc.get_state_dict(model), load_file(folder + ".safetensors")
    assert all(torch.equal(got[k].cpu(), expected[k]) for k in expected)
    assert any("ZeRO stage 3 on 1 processes" in m for m in caught), caught
    x, y = next(iter(loader))
    acc.backward(nn.functional.mse_loss(model(x), y))
    return len(caught)


def check_zero3_fp32_keeps_one_copy_of_partitions():
    """fp32 ZeRO-3 holds each parameter partition once: the optimizer's master partitions are the parameter
    partitions (DeepSpeed would clone them), and the CPU reduce bucket is not DeepSpeed's 1.9 GB default."""
    acc = _accelerator(zero_stage=3, gradient_clipping=1.0)
    m = _model()
    model, opt, loader = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=0.01),
                                     torch.utils.data.DataLoader(_data(), batch_size=2))
    for x, y in loader:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    def storages(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors}

    partitions = storages(p.ds_tensor for p in model.module.parameters())
    masters = storages(k for k in opt.optimizer.state)
    assert masters <= partitions, (masters, partitions)
    numel = sum(p.ds_numel for p in model.module.parameters())
    if acc.device.type == "cpu":  # hasten sizes the reduce bucket on CPU only; GPUs keep DeepSpeed's
        assert model.optimizer.reduce_bucket_size == numel, model.optimizer.reduce_bucket_size
    return len(partitions)


def _fp16_capable(enable: bool):
    """DeepSpeed refuses fp16 on CPUs without oneDNN fp16; the overflow check lifts that on its own engine."""
    from deepspeed.accelerator import get_accelerator

    kind = type(get_accelerator())
    original = kind.__dict__.get("is_fp16_supported")
    if enable:
        kind.is_fp16_supported = lambda self: True
    return kind, original


def check_fp16_on_cpu_without_support_is_one_clear_error():
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        return "supported"
    try:
        acc = _accelerator(mixed_precision="fp16", zero_stage=2, gradient_clipping=1.0)
        _prepared(acc)
    except ValueError as e:
        assert "mixed_precision='fp16'" in str(e) and "bf16" in str(e), str(e)
        return str(e)
    raise AssertionError("fp16 DeepSpeed on a CPU without fp16 support did not fail")


def check_fp16_overflow_skips_step_and_scheduler():
    kind, original = _fp16_capable(True)
    try:
        return [_fp16_overflow(stage) for stage in (2, 3)]
    finally:
        kind.is_fp16_supported = original


def _fp16_overflow(stage):
    # A small initial loss scale: DeepSpeed's 2**16 overflows (and skips) the first steps of its own accord.
    acc = _accelerator(mixed_precision="fp16", hf_ds_config={"zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
                                                             "fp16": {"enabled": "auto", "initial_scale_power": 4}})
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader, sched = acc.prepare(m, opt, torch.utils.data.DataLoader(_data(), batch_size=2), sched)
    seen = []
    for i, (x, y) in enumerate(loader):
        if i == 3:
            break
        before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}  # on CPU it may alias the weights
        lr = sched.get_last_lr()[0]
        loss = nn.functional.mse_loss(model(x.half()).float(), y)
        acc.backward(loss * float("inf") if i == 1 else loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        after = acc.get_state_dict(model)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        seen.append((acc.optimizer_step_was_skipped, unchanged, sched.get_last_lr()[0] == lr))
    assert seen == [(False, False, False), (True, True, True), (False, False, False)], (stage, seen)
    return seen


def check_tampered_engine_checkpoint_runs_nothing():
    """A ZeRO-2 checkpoint whose model states file was replaced by a pickle that opens a file, resumed by the
    layout that wrote it (DeepSpeed's own loader): every process refuses it, naming the file and the global,
    before anything in it runs and before anything changes. The untampered copy still resumes."""
    import shutil

    from distributed import evil_pickle, refused_load, tamper

    root = os.environ["HASTEN_TEST_TMP"]
    folder, evil = os.path.join(root, "untampered"), os.path.join(root, "tampered")
    marker = os.path.join(root, "created_by_a_pickle")
    name = os.path.join("deepspeed", "model_0", "mp_rank_00_model_states.pt")
    acc, model = _trained(2, folder)
    if acc.is_main_process:
        shutil.copytree(folder, evil)
        tamper(evil, name, evil_pickle(marker))
    acc.wait_for_everyone()
    acc.free_memory()
    acc, model = _trained(2, steps=1)
    before = acc.get_state_dict(model)
    message = refused_load(acc, evil, marker)
    assert os.path.join(evil, name) in message and "io.open" in message and "tampered" in message, message
    assert "nothing was changed" in message, message
    after = acc.get_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    with open(os.path.join(folder, "manifest.json")) as f:
        files = json.load(f)["files"]
    engine_files = {n: info["checksum"] for n, info in files.items() if n.startswith("deepspeed")}
    assert len(engine_files) >= 3 and all(engine_files.values()), engine_files  # checksummed by their writers
    acc.load_state(folder, verify="checksum")
    return message
