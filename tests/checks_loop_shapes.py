"""The loop-shape matrix inside each rank (see distributed.py and test_loop_shapes.py).

Every shape a training loop can take around ``accelerator.backward`` (with or without
``optimizer.step()``, a scheduler, ``clip_grad_norm_``, accumulation, and an eval forward,
``get_state_dict`` or ``save_state`` between ``backward`` and the clip) is run under one strategy
and compared with one plain PyTorch process on the same global batches: the weights after every
step, the norms the clip returned, what the eval forward and the state dict saw. A shape hasten
refuses must raise before anything changes: the loop then goes on without that call and still
equals the reference.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any

import torch
from torch import nn

from distributed import reset_state
from hasten import Accelerator

FEATURES, PER_RANK, STEPS, LR, CLIP = 4, 2, 4, 0.2, 0.5
AUTO_CLIP = 1.0  # what a DeepSpeed config's "gradient_clipping": "auto" means (Accelerate's rule)
BETWEEN = ("none", "eval", "state_dict", "save")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


def _batches(count: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (world x PER_RANK rows); rank r takes rows [r*PER_RANK, (r+1)*PER_RANK)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        x = torch.randn(world * PER_RANK, FEATURES, generator=g) * 3
        out.append((x, torch.cat([x[:, :1].sin(), x[:, 1:2] * 2], 1)))
    return out


def _schedule(step: int) -> float:
    return 0.5 ** step  # steep: a schedule one step early or late is far off


def shapes(backend: str) -> list[dict[str, Any]]:
    """The shapes run under ``backend``: a loop calling ``optimizer.step()`` everywhere, and under
    DeepSpeed also the loop that leaves the step to ``backward`` (Accelerate's DeepSpeed contract)."""
    out = []
    for sched, accum in itertools.product((False, True), (1, 2)):
        out.append(dict(step=True, sched=sched, accum=accum, clip=False, between="none"))
        for between in BETWEEN:
            out.append(dict(step=True, sched=sched, accum=accum, clip=True, between=between))
        if backend.startswith("zero"):
            for clip in (False, True):
                out.append(dict(step=False, sched=sched, accum=accum, clip=clip, between="none"))
    if backend.startswith("zero"):
        for between in ("eval", "state_dict"):
            out.append(dict(step=False, sched=True, accum=1, clip=False, between=between))
    return out


def name_of(shape: dict[str, Any]) -> str:
    return (f"{'step' if shape['step'] else 'nostep'}-{'sched' if shape['sched'] else 'nosched'}-"
            f"{'clip' if shape['clip'] else 'noclip'}-acc{shape['accum']}-{shape['between']}")


def reference(shape: dict[str, Any], backend: str, world: int, device: torch.device) -> dict[str, Any]:
    """One plain PyTorch process on the global batches: what each step's calls see and return."""
    model = _model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule) if shape["sched"] else None
    accum = shape["accum"]
    auto_clip = backend.startswith("zero") and not shape["clip"]
    seen: dict[str, list] = {"norms": [], "eval": [], "state_dict": [], "weights": []}
    batches = _batches(STEPS * accum, world)
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        # The mean over the global batch: the processes' mean losses, averaged by the reduction.
        loss = nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum:
            continue
        # A loop without optimizer.step() (Accelerate's "backward steps") sees the stepped model from
        # the moment hasten has learnt that shape: the second step on; before it, the step is held.
        after = not shape["step"] and i >= accum
        if not after:
            _read(seen, shape, model, x)
        if shape["clip"]:
            seen["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        elif auto_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), AUTO_CLIP)
        opt.step()
        if sched is not None:
            for _ in range(world):  # Accelerate's rule: num_processes scheduler steps per optimizer step
                sched.step()
        opt.zero_grad()
        if after:
            _read(seen, shape, model, x)
        seen["weights"].append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    return seen


def _read(seen: dict, shape: dict[str, Any], model: nn.Module, x: torch.Tensor) -> None:
    if shape["between"] == "eval":
        with torch.no_grad():
            seen["eval"].append(model(x[:PER_RANK]).sum().item())
    if shape["between"] == "state_dict":
        seen["state_dict"].append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})


def _accelerator(backend: str, accum: int) -> Accelerator:
    reset_state()
    if backend == "ddp":
        return Accelerator(gradient_accumulation_steps=accum)
    if backend == "fsdp2":
        from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

        return Accelerator(gradient_accumulation_steps=accum,
                           fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

    stage = int(backend[len("zero"):])
    # A migrated script's JSON: everything the integration fills is "auto".
    config = {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}
    return Accelerator(gradient_accumulation_steps=accum, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))


def _close(a: dict, b: dict, tol: float) -> float:
    """The largest difference relative to each tensor's scale (at least 1); asserted <= ``tol``.
    ``a`` is ``get_state_dict``'s: empty on processes other than 0 where the strategy gathers to 0 (FSDP2)."""
    if not a and torch.distributed.is_initialized() and torch.distributed.get_rank() > 0:
        return 0.0
    worst = max(float((a[k].float().cpu() - b[k].float()).abs().max()) / max(1.0, float(b[k].abs().max()))
                for k in b)
    assert worst <= tol, worst
    return worst


def run_shape(shape: dict[str, Any], backend: str, folder: str, tol: float = 1e-6) -> dict[str, Any]:
    """Run ``shape`` under ``backend`` and compare it with the reference; returns what was compared."""
    acc = _accelerator(backend, shape["accum"])
    world, rank = acc.num_processes, acc.process_index
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule) if shape["sched"] else None
    objects = [model, opt] + ([sched] if sched is not None else [])
    prepared = acc.prepare(*objects)
    model, opt = prepared[0], prepared[1]
    sched = prepared[2] if sched is not None else None
    ref = reference(shape, backend, world, acc.device)
    accum = shape["accum"]
    got: dict[str, list] = {"norms": [], "eval": [], "refused": []}
    for i, (x, y) in enumerate(_batches(STEPS * accum, world)):
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK].to(acc.device), y[rank * PER_RANK:(rank + 1) * PER_RANK].to(acc.device)
        k = i // accum  # the optimizer step this micro-step belongs to
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            if acc.sync_gradients:
                if shape["between"] == "eval":
                    with torch.no_grad():
                        x0 = _batches(STEPS * accum, world)[i][0][:PER_RANK].to(acc.device)
                        value = model(x0).sum().item()
                    got["eval"].append(value)
                    assert abs(value - ref["eval"][k]) <= 1e-5, (k, value, ref["eval"][k])
                if shape["between"] == "state_dict":
                    _close(acc.get_state_dict(model), ref["state_dict"][k], tol)
                if shape["between"] == "save" and k == 1:
                    try:
                        acc.save_state(os.path.join(folder, "ckpt"))
                    except (ValueError, RuntimeError) as e:  # every process learns of a refusal: RuntimeError
                        got["refused"].append(" ".join(str(e).split())[:300])
                if shape["clip"]:
                    got["norms"].append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            if shape["step"]:
                opt.step()
            if sched is not None:
                sched.step()
            if shape["step"]:
                opt.zero_grad()
        if acc.sync_gradients and shape["step"]:
            # The loop's step ran: the weights are the reference's after the same step. (A loop without
            # optimizer.step() gets its step at the next forward or backward: checked there.)
            _close(acc.get_state_dict(model), ref["weights"][k], tol)
    weights = acc.get_state_dict(model)
    worst = _close(weights, ref["weights"][-1], tol)
    assert len(got["norms"]) == len(ref["norms"]), (got["norms"], ref["norms"])
    for a, b in zip(got["norms"], ref["norms"]):
        assert abs(a - b) <= 1e-5 * max(1.0, b), (got["norms"], ref["norms"])
    if sched is not None:
        assert abs(sched.get_last_lr()[0] - LR * _schedule(STEPS * world)) < 1e-12, sched.get_last_lr()
    return {"worst": worst, "norms": got["norms"], "refused": got["refused"]}


def _matrix(backend: str) -> dict[str, Any]:
    out = {}
    shared = os.environ.get("HASTEN_TEST_TMP")  # every rank's same folder (save_state is collective)
    with tempfile.TemporaryDirectory(dir=shared, prefix=f"{backend}-") if shared is None else \
            _Folder(os.path.join(shared, backend)) as folder:
        for shape in shapes(backend):
            name = name_of(shape)
            try:
                out[name] = run_shape(shape, backend, os.path.join(folder, name))
            except AssertionError as e:
                out[name] = {"failed": f"AssertionError: {e}"}
            except Exception as e:  # noqa: BLE001 - reported per shape, judged by the test
                out[name] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


class _Folder:
    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> str:
        os.makedirs(self.path, exist_ok=True)
        return self.path

    def __exit__(self, *exc: Any) -> None:
        pass


def check_matrix_ddp():
    return _matrix("ddp")


def check_matrix_fsdp2():
    return _matrix("fsdp2")


def check_matrix_zero1():
    return _matrix("zero1")


def check_matrix_zero2():
    return _matrix("zero2")


def check_matrix_zero3():
    return _matrix("zero3")


# -- one check per DeepSpeed fix (each failed before it) ------------------------------------------
def _zero2(clipping: Any = 0.0, json: bool = True, **config: Any) -> tuple[Accelerator, Any, Any, Any]:
    """ZeRO-2 with a torch SGD and LambdaLR; ``clipping`` None leaves the plugin's default; ``json``
    False builds the plugin from its fields (no JSON)."""
    from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

    reset_state()
    if json:
        plugin = DeepSpeedPlugin(hf_ds_config=dict({"train_micro_batch_size_per_gpu": PER_RANK,
                                                    "zero_optimization": {"stage": 2}}, **config),
                                 gradient_clipping=clipping)
    else:
        plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=clipping)
    acc = Accelerator(deepspeed_plugin=plugin)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    loader = torch.utils.data.DataLoader(torch.zeros(8, 1), batch_size=PER_RANK)  # fills the micro-batch size
    model, opt, sched, _ = acc.prepare(model, opt, sched, loader)
    return acc, model, opt, sched


def _local(acc: Accelerator, x: torch.Tensor) -> torch.Tensor:
    r = acc.process_index
    return x[r * PER_RANK:(r + 1) * PER_RANK].to(acc.device)


def check_scheduler_step_without_optimizer_step():
    """Accelerate's DeepSpeed loop ``backward(loss); scheduler.step()``: the schedule advances after the
    update of its iteration, as plain PyTorch's ``step(); scheduler.step()`` (it used to run first)."""
    acc, model, opt, sched = _zero2(0.0)
    ref = reference(dict(step=True, sched=True, accum=1, clip=False, between="none"), "ddp", acc.num_processes,
                    acc.device)
    for x, y in _batches(STEPS, acc.num_processes):
        acc.backward(nn.functional.mse_loss(model(_local(acc, x)), _local(acc, y)))
        sched.step()
    return _close(acc.get_state_dict(model), ref["weights"][-1], 1e-6)


def check_clip_after_an_eval_forward_still_clips():
    """``backward``, a metric under ``no_grad``, ``clip_grad_norm_``, ``step``: the clip clips (it used to
    find the step already run by the forward and return the norm without clipping)."""
    acc, model, opt, sched = _zero2(0.0)
    shape = dict(step=True, sched=True, accum=1, clip=True, between="eval")
    ref = reference(shape, "ddp", acc.num_processes, acc.device)
    norms = []
    for k, (x, y) in enumerate(_batches(STEPS, acc.num_processes)):
        acc.backward(nn.functional.mse_loss(model(_local(acc, x)), _local(acc, y)))
        with torch.no_grad():
            seen = model(x[:PER_RANK].to(acc.device)).sum().item()
        assert abs(seen - ref["eval"][k]) <= 1e-5, (k, seen, ref["eval"][k])
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref["norms"])), (norms, ref["norms"])
    return _close(acc.get_state_dict(model), ref["weights"][-1], 1e-6)


def check_clip_after_the_step_ran_is_an_error():
    """A training forward between ``backward`` and ``clip_grad_norm_`` runs the held step (a loop
    without optimizer.step() needs it there); the clip after it is an error naming the order."""
    acc, model, opt, sched = _zero2(0.0)
    x, y = _batches(1, acc.num_processes)[0]
    acc.backward(nn.functional.mse_loss(model(_local(acc, x)), _local(acc, y)))
    model(_local(acc, x))  # gradients enabled: the step runs
    try:
        acc.clip_grad_norm_(model.parameters(), CLIP)
    except ValueError as e:
        assert "clip_grad_norm_ after a forward with gradients enabled ran the DeepSpeed step" in str(e), str(e)
        return str(e)
    raise AssertionError("clip_grad_norm_ after the step ran returned instead of raising")


def check_auto_gradient_clipping_is_accelerates():
    """``gradient_clipping: "auto"`` (and the default plugin) clips at 1.0, or at the plugin's value, as
    Accelerate fills it; a clip_grad_norm_ call of a step still clips that step at its max_norm."""
    seen = {}
    cases = (("plugin default", None, False, {}), ("plugin 0 (no clipping)", 0.0, False, {}),
             ("json auto", None, True, {"gradient_clipping": "auto"}),
             ("json auto + plugin 0.3", 0.3, True, {"gradient_clipping": "auto"}),
             ("json without the key (DeepSpeed's 0)", None, True, {}))
    for label, clipping, json, config in cases:
        acc, model, opt, sched = _zero2(clipping, json, **config)
        seen[label] = float(model.gradient_clipping())
    assert seen == {"plugin default": 1.0, "plugin 0 (no clipping)": 0.0, "json auto": 1.0,
                    "json auto + plugin 0.3": 0.3, "json without the key (DeepSpeed's 0)": 0.0}, seen
    # Without clip_grad_norm_, the auto-filled 1.0 clips; with the call, its max_norm does.
    for shape in (dict(step=True, sched=False, accum=1, clip=False, between="none"),
                  dict(step=True, sched=False, accum=1, clip=True, between="none")):
        acc, model, opt, sched = _zero2(None, json=False)
        ref = reference(shape, "zero2", acc.num_processes, acc.device)
        for x, y in _batches(STEPS, acc.num_processes):
            acc.backward(nn.functional.mse_loss(model(_local(acc, x)), _local(acc, y)))
            if shape["clip"]:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        _close(acc.get_state_dict(model), ref["weights"][-1], 1e-6)
    return seen
