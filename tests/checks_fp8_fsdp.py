"""fp8 (torchao) with FSDP2 and float8 all-gather, inside each of 2 ranks. See distributed.py.

Two references: the same job written by hand the way torchtitan does it (convert, ``fully_shard``
with a bf16 policy, ``precompute_float8_dynamic_scale_for_fsdp`` after each step), which hasten must
match exactly; and one process running the two shards in turn under autocast
(``fp8_common.per_shard_reference``), which it must track within a stated tolerance.
"""

import os

import torch

from distributed import reset_state
from fp8_common import loss_of, make_data, make_model, per_shard_reference
from hasten import Accelerator
from hasten.utils import AORecipeKwargs
from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

BATCH = 8  # per rank
CONVERTED = ("2", "4")  # the inner Linear layers the default filter converts
# FSDP2 runs the unconverted layers with bf16 weights (the policy), the one-process reference under
# bf16 autocast; measured, the weights after 4 steps are bitwise equal. The margin allows the
# gradient average to round its last bit differently (as for DDP in checks_fp8.py); the weights
# of the float8 layers move by ~2e-3 over these steps, so training nothing could not pass.
TRACKING_TOLERANCE = 1e-6


def _accelerator(accumulate=1, recipe=None, **plugin):
    reset_state()
    return Accelerator(mixed_precision="fp8", fsdp_plugin=Plugin(fsdp_version=2, **plugin),
                       kwargs_handlers=[recipe or AORecipeKwargs()], gradient_accumulation_steps=accumulate)


def _batch(step, rank, device):
    x, y = make_data(device=device)
    start = ((step * 2 + rank) * BATCH) % len(x)
    return x[start:start + BATCH], y[start:start + BATCH]


def _full(acc, model):
    return {k: v.clone() for k, v in acc.strategy.model_state_dict(model, everyone=True).items()}


def _local_scale(model, name):
    """The precomputed float8 scale object of a converted layer's local weight shard (None before any step)."""
    return dict(model.named_modules())[name].weight._local_tensor._precomputed_scale


def _hasten_run(steps, accumulate, build_optimizer_first=True):
    acc = _accelerator(accumulate)
    model = make_model()
    if build_optimizer_first:  # the usual order: the optimizer holds the weights from before conversion
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = acc.prepare(model, opt)
    else:
        model = acc.prepare(model)
        opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.05))
    gathered = []
    hook = model[2].register_forward_pre_hook(lambda m, args: gathered.append(m.weight))
    scales, losses = [], []
    for step in range(steps):
        x, y = _batch(step, acc.process_index, acc.device)
        with acc.accumulate(model):
            loss = loss_of(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        scales.append(_local_scale(model, "2"))
        losses.append(loss.item())
    hook.remove()
    return acc, model, opt, gathered, scales, losses


def _hand_written(steps, accumulate, device):
    """torchao + FSDP2 by hand, as torchtitan does it, on ``device``; the full weights on CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    model = make_model().to(device)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda module, fqn: fqn in CONVERTED)
    fully_shard(model, mesh=init_device_mesh(device.type, (2,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = torch.distributed.get_rank()
    for step in range(steps):
        sync = (step + 1) % accumulate == 0
        model.set_requires_gradient_sync(sync)
        x, y = _batch(step, rank, device)
        (loss_of(model(x), y) / accumulate).backward()
        if sync:
            opt.step()
            opt.zero_grad()
            precompute_float8_dynamic_scale_for_fsdp(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: getattr(v, "_tensor", v).cpu() for k, v in state.items()}


def _compare(accumulate, build_optimizer_first=True):
    steps = 4 * accumulate
    acc, model, opt, gathered, scales, _ = _hasten_run(steps, accumulate, build_optimizer_first)
    got = _full(acc, model)
    by_hand = _hand_written(steps, accumulate, acc.device)
    exact = max(float((got[k] - by_hand[k]).abs().max()) for k in by_hand)
    assert exact == 0.0, f"hasten differs from the hand-written torchao + FSDP2 loop by {exact}"
    ref = {k: v.cpu() for k, v in per_shard_reference(steps, accumulate, BATCH, device=acc.device).state_dict().items()}
    start = make_model().state_dict()
    tracking = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert tracking < TRACKING_TOLERANCE, f"worst weight gap to one process: {tracking}"
    moved = min(float((got[f"{n}.weight"] - start[f"{n}.weight"]).abs().max()) for n in CONVERTED)
    assert moved > 1000 * TRACKING_TOLERANCE, f"the float8 layers barely trained ({moved}); the comparison proves nothing"
    # The weight the float8 layer computes with is what FSDP2 all-gathered: float8 data with a scale.
    kinds = {(type(w).__name__, str(getattr(w, "_data", w).dtype)) for w in gathered}
    assert kinds == {("Float8TrainingTensor", "torch.float8_e4m3fn")}, kinds
    local = {type(p._local_tensor).__name__ for g in opt.param_groups for p in g["params"]}
    assert local == {"Tensor", "WeightWithDynamicFloat8CastTensor"}, local  # the optimizer trains the shards
    # A new scale is computed after each real optimizer step, never on an accumulation micro-step.
    fresh = [i for i in range(steps) if scales[i] is not (scales[i - 1] if i else None)]
    assert fresh == [i for i in range(steps) if (i + 1) % accumulate == 0], fresh
    return {"exact": exact, "tracking": tracking, "moved": moved}


def check_float8_all_gather_matches_hand_written_loop():
    return _compare(accumulate=1)


def check_gradient_accumulation_optimizer_built_after_prepare():
    return _compare(accumulate=2, build_optimizer_first=False)


def check_rank0_loading_layer_wrap_and_activation_checkpointing():
    """Process 1 builds on meta, each Linear is its own FSDP unit, activations are recomputed:
    the same numbers as the plain run."""
    from hasten import init_empty_weights

    acc = _accelerator(cpu_ram_efficient_loading=True, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=500,
                       activation_checkpointing=True)
    if acc.is_main_process:
        model = make_model()
    else:
        with init_empty_weights():
            model = make_model(seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    assert _full(acc, model).keys() == make_model().state_dict().keys()
    assert all(torch.equal(v, make_model().state_dict()[k]) for k, v in _full(acc, model).items())
    wrapped = [n for n, p in model.named_parameters() if type(p._local_tensor).__name__ != "Tensor"]
    assert wrapped == [f"{n}._checkpoint_wrapped_module.weight" for n in CONVERTED], wrapped
    for step in range(4):
        x, y = _batch(step, acc.process_index, acc.device)
        acc.backward(loss_of(model(x), y))
        opt.step()
        opt.zero_grad()
    got = _full(acc, model)
    acc, plain, *_ = _hasten_run(4, 1)
    expected = _full(acc, plain)
    worst = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    assert worst == 0.0, worst
    return worst


def _resume_setup():
    acc = _accelerator()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return acc, *acc.prepare(model, opt)


def _steps(acc, model, opt, first, count):
    losses = []
    for step in range(first, first + count):
        x, y = _batch(step, acc.process_index, acc.device)
        loss = loss_of(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_save_state_resumes_exactly():
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "fp8_fsdp_resume")
    acc, model, opt = _resume_setup()
    _steps(acc, model, opt, 0, 3)
    acc.save_state(folder)
    after_save = _steps(acc, model, opt, 3, 3)
    final = _full(acc, model)
    # The same Accelerator goes back to the checkpoint: the float8 scales must follow the loaded weights.
    acc.load_state(folder, continue_dataloaders=True)
    rolled_back = _steps(acc, model, opt, 3, 3)
    assert rolled_back == after_save, (rolled_back, after_save)
    # A fresh run resumes from it.
    acc, model, opt = _resume_setup()
    acc.load_state(folder, continue_dataloaders=True)
    resumed = _steps(acc, model, opt, 3, 3)
    again = _full(acc, model)
    assert resumed == after_save, (resumed, after_save)
    assert all(torch.equal(final[k], again[k]) for k in final)
    return resumed


def check_weights_are_plain_and_load_into_unconverted_model():
    from safetensors.torch import load_file

    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], "fp8_fsdp_weights")
    acc, model, opt = _resume_setup()
    _steps(acc, model, opt, 0, 2)
    state = acc.get_state_dict(model)
    acc.save_model(model, folder)
    acc.wait_for_everyone()
    full = _full(acc, model)
    saved = load_file(os.path.join(folder, "model.safetensors"))
    plain = make_model(seed=5)
    plain.load_state_dict(saved)  # strict: same names, same shapes
    for name, value in list(saved.items()) + list(state.items()) + list(full.items()):
        assert type(value) is torch.Tensor and value.dtype == torch.float32, (name, type(value), value.dtype)
    assert all(torch.equal(plain.state_dict()[k], full[k]) for k in full)
    if acc.is_main_process:
        assert all(torch.equal(state[k].cpu(), full[k]) for k in full)
    moved = float((full["2.weight"] - make_model().state_dict()["2.weight"]).abs().max())
    assert moved > 0, "the converted layer did not train"
    return sorted(saved)


def check_rowwise_recipe_all_gathers_in_high_precision():
    """torchao all-gathers only tensorwise weights in float8; the rowwise recipe trains with a bf16 all-gather."""
    acc = _accelerator(recipe=AORecipeKwargs(config="rowwise"))
    assert acc.fp8.float8_all_gather is False
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    assert type(model[2]).__name__ == "Float8Linear"
    assert {type(p._local_tensor).__name__ for p in model.parameters()} == {"Tensor"}
    gathered = []
    model[2].register_forward_pre_hook(lambda m, args: gathered.append((type(m.weight).__name__, m.weight.dtype)))
    losses = _steps(acc, model, opt, 0, 3)
    assert gathered and set(gathered) == {("Parameter", torch.bfloat16)}, gathered
    assert _full(acc, model)["2.weight"].ne(make_model().state_dict()["2.weight"]).any()
    return losses


def four_ranks_fp8_with_tensor_parallel_is_refused():
    """Run on 4 processes (dp_shard 2 x tp 2) by test_fp8_fsdp.py."""
    from hasten.utils import ParallelismConfig

    reset_state()
    try:
        Accelerator(mixed_precision="fp8", fsdp_plugin=Plugin(fsdp_version=2),
                    parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    except NotImplementedError as e:
        assert "tp_size" in str(e) and "tensor parallelism" in str(e), str(e)
        return str(e)
    raise AssertionError("fp8 with FSDP2 and tp_size=2 was accepted")
