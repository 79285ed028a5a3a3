"""Several models in one job, inside each rank (see distributed.py and test_several_models.py).

A trained model beside a frozen one, as post-training scripts run them: a student distilled from a
teacher (KL between their token distributions) and a DPO step (policy log-probs against a frozen
reference's). Each strategy (DDP, FSDP2, DeepSpeed ZeRO-2/3) trains on 2 processes x batch B and
is compared with plain PyTorch on one process x batch 2B; a run saved mid-way and resumed in a
fresh Accelerator ends with the very same parameters as the uninterrupted run.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from checks_checkpoint_resume import Progress
from distributed import reset_state
from hasten import Accelerator
from hasten.utils import set_seed

VOCAB, HIDDEN, SEQ, N, B = 16, 12, 6, 32, 2


class TinyLM(nn.Module):
    """A next-token model: embedding, two residual blocks, a head (FSDP2 can shard each block)."""

    def __init__(self, seed: int, hidden: int = HIDDEN) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def frozen(model: nn.Module) -> nn.Module:
    """A reference / teacher: evaluation mode, no gradients."""
    return model.eval().requires_grad_(False)


def data(kind: str) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    if kind == "distill":
        return torch.utils.data.TensorDataset(ids)
    return torch.utils.data.TensorDataset(ids, torch.randint(0, VOCAB, (N, SEQ), generator=g))  # chosen, rejected


def distill_loss(student: nn.Module, teacher: nn.Module, batch: tuple) -> torch.Tensor:
    (ids,) = batch
    with torch.no_grad():
        target = F.softmax(teacher(ids).float() / 2.0, dim=-1)
    logp = F.log_softmax(student(ids).float() / 2.0, dim=-1)
    return F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), reduction="batchmean")


def sequence_logp(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    return torch.gather(F.log_softmax(logits, -1), 2, ids[:, 1:, None]).squeeze(2).sum(1)


def dpo_loss(policy: nn.Module, reference: nn.Module, batch: tuple, beta: float = 0.5) -> torch.Tensor:
    chosen, rejected = batch
    with torch.no_grad():
        ref_c, ref_r = sequence_logp(reference, chosen), sequence_logp(reference, rejected)
    margin = (sequence_logp(policy, chosen) - ref_c) - (sequence_logp(policy, rejected) - ref_r)
    return -F.logsigmoid(beta * margin).mean()


LOSSES: dict[str, Callable] = {"distill": distill_loss, "dpo": dpo_loss}


def models(kind: str) -> tuple[nn.Module, nn.Module]:
    """(trained, frozen): a student and a wider teacher, or a policy and its reference (the same start)."""
    if kind == "distill":
        return TinyLM(1), frozen(TinyLM(2, hidden=20))
    return TinyLM(1), frozen(TinyLM(1))


def reference_run(kind: str, steps: int, accum: int, clip: Optional[float], world: int, device: Any,
                  optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """Plain PyTorch on one process, each micro-step on the global batch (world x B, the sampler's
    interleaving); returns the trained model's weights on CPU."""
    trained, other = (m.to(device) for m in models(kind))
    opt = _optimizer(trained, optimizer)
    batches = list(torch.utils.data.DataLoader(data(kind), batch_size=B))
    for step in range(steps):
        group = batches[step * world:(step + 1) * world]
        batch = tuple(torch.cat([b[j] for b in group]).to(device) for j in range(len(group[0])))
        (LOSSES[kind](trained, other, batch) / accum).backward()
        if (step + 1) % accum == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(trained.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return {k: v.detach().cpu() for k, v in trained.state_dict().items()}


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def prepare_pair(acc: Accelerator, kind: str, together: bool, optimizer: str = "sgd",
                 select: Optional[tuple[str, str]] = None, shuffle: bool = False) -> tuple:
    """(trained, frozen, optimizer, loader) prepared in one ``prepare`` call or in two; ``select``:
    the DeepSpeed plugin names of the trained and the frozen model, selected before each is prepared."""
    trained, other = models(kind)
    opt = _optimizer(trained, optimizer)
    loader = torch.utils.data.DataLoader(data(kind), batch_size=B, shuffle=shuffle)
    if together:
        trained, other, opt, loader = acc.prepare(trained, other, opt, loader)
    else:
        trained, opt, loader = acc.prepare(trained, opt, loader)
        if select is not None:
            acc.state.select_deepspeed_plugin(select[1])
        other = acc.prepare(other)
        if select is not None:
            acc.state.select_deepspeed_plugin(select[0])
    return trained, other, opt, loader


def train(acc: Accelerator, kind: str, trained: nn.Module, other: nn.Module, opt: Any, batches: list,
          clip: Optional[float], both: bool = False) -> list[float]:
    """One loop as users write it: accumulate (the trained model, or ``both``), backward, clip on
    sync steps, step; returns the losses."""
    losses = []
    for batch in batches:
        with acc.accumulate(*((trained, other) if both else (trained,))):
            loss = LOSSES[kind](trained, other, batch)
            acc.backward(loss)
            if clip is not None and acc.sync_gradients:
                acc.clip_grad_norm_(trained.parameters(), clip)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def full_weights(acc: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on every process (``get_state_dict`` gives them to process 0 alone under FSDP2)."""
    inner = acc.unwrap_model(model)
    return {k: v.detach().cpu().clone() for k, v in acc.strategy.model_state_dict(inner, everyone=True).items()}


def worst(got: dict, want: dict) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


def equivalence(make: Callable[[], Accelerator], kind: str, together: bool, accum: int, clip: Optional[float],
                select: Optional[tuple[str, str]] = None, tolerance: float = 1e-5, both: bool = False,
                engines: Optional[tuple[int, int]] = None, save_as: Optional[str] = None) -> dict:
    """2 processes x B equal 1 process x 2B; the frozen model is unchanged, in eval mode, without
    gradients; with ``save_as``, then each model's ``get_state_dict`` / ``save_model`` too."""
    acc = make()
    trained, other, opt, loader = prepare_pair(acc, kind, together, select=select)
    if engines is not None:  # DeepSpeed: (ZeRO stage of the trained engine, of the frozen one's)
        assert [m.zero_optimization_stage() for m in (trained, other)] == list(engines)
        partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in acc.unwrap_model(other).parameters())
        assert partitioned == (engines[1] == 3), partitioned
    steps = 4 * accum
    batches = list(loader)[:steps]
    train(acc, kind, trained, other, opt, batches, clip, both)
    got = full_weights(acc, trained)
    want = reference_run(kind, steps, accum, clip, acc.num_processes, acc.device)
    diff = worst(got, want)
    assert diff < tolerance, diff
    start = models(kind)[1].state_dict()
    frozen_diff = worst(full_weights(acc, other), start)
    assert frozen_diff == 0.0, frozen_diff
    inner = acc.unwrap_model(other)
    assert isinstance(inner, TinyLM) and not inner.training, (type(inner), inner.training)
    assert not any(p.requires_grad or p.grad is not None for p in inner.parameters())
    assert isinstance(acc.unwrap_model(trained), TinyLM)
    saved = save_models_each(acc, (trained, other), save_as) if save_as else None
    return {"worst": diff, "models": len(acc._models), "saved": saved}


def save_models_each(acc: Accelerator, pair: tuple, tag: str) -> list:
    """``get_state_dict`` and ``save_model`` of each prepared model give its full weights."""
    from safetensors.torch import load_file

    written = []
    for name, model in zip(("trained", "frozen"), pair):
        folder = os.path.join(os.environ["HASTEN_TEST_TMP"], f"save-{tag}-{name}")
        expected = full_weights(acc, model)
        given = acc.get_state_dict(model)  # process 0 holds them (every process, except under FSDP2)
        if acc.is_main_process:
            assert worst({k: v.cpu() for k, v in given.items()}, expected) == 0.0
        acc.save_model(model, folder)
        acc.wait_for_everyone()
        loaded = load_file(os.path.join(folder, "model.safetensors"))
        assert worst(loaded, expected) == 0.0
        written.append(len(loaded))
    return written


def _resume_run(make: Callable[[], Accelerator], kind: str, folder: str, together: bool, steps: int,
                save_at: Optional[int], select: Optional[tuple[str, str]]) -> tuple[dict, dict, dict]:
    """AdamW on shuffled data; saves at ``save_at``, or (None) loads ``folder`` first and runs the rest."""
    set_seed(11)
    acc = make()
    trained, other, opt, loader = prepare_pair(acc, kind, together, optimizer="adamw", select=select, shuffle=True)
    counter = Progress()  # steps done, stored in the checkpoint
    acc.register_for_checkpointing(counter)
    if save_at is None:
        with torch.no_grad():  # the frozen model must come back from the checkpoint too
            for p in acc.unwrap_model(other).parameters():
                p.add_(1.0)
        acc.load_state(folder, continue_dataloaders=True)
    losses = {}
    while counter.steps < steps:
        for batch in loader:
            if counter.steps == steps:
                break
            losses[counter.steps] = train(acc, kind, trained, other, opt, [batch], None)[0]
            counter.steps += 1
            if counter.steps == save_at:
                acc.save_state(folder)
    return losses, full_weights(acc, trained), full_weights(acc, other)


def exact_resume(make: Callable[[], Accelerator], name: str, kind: str, together: bool,
                 select: Optional[tuple[str, str]] = None, steps: int = 12, save_at: int = 5) -> dict:
    folder = os.path.join(os.environ["HASTEN_TEST_TMP"], name)
    full, weights, frozen_weights = _resume_run(make, kind, folder, together, steps, save_at, select)
    rest, weights2, frozen2 = _resume_run(make, kind, folder, together, steps, None, select)
    assert sorted(rest) == list(range(save_at, steps)) and all(full[k] == v for k, v in rest.items()), (full, rest)
    assert worst(weights2, weights) == 0.0 and worst(frozen2, frozen_weights) == 0.0
    import json

    with open(os.path.join(folder, "manifest.json")) as f:
        held = json.load(f)["contents"]["models"]
    assert len(held) == 2, held
    return {"resumed_steps": len(rest), "models": len(held)}  # the losses differ by rank (each its own batches)


# -- DDP ----------------------------------------------------------------------------------------
def ddp(accum: int = 1) -> Callable[[], Accelerator]:
    def make() -> Accelerator:
        reset_state()
        return Accelerator(gradient_accumulation_steps=accum)
    return make


def check_ddp_distill_one_call():
    return equivalence(ddp(2), "distill", together=True, accum=2, clip=0.5, save_as="ddp")


def check_ddp_dpo_separate_calls():
    return equivalence(ddp(2), "dpo", together=False, accum=2, clip=0.5, both=True)


def check_ddp_exact_resume():
    return exact_resume(ddp(), "ddp-resume", "dpo", together=True)


# -- FSDP2 --------------------------------------------------------------------------------------
def fsdp2(accum: int = 1) -> Callable[[], Accelerator]:
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    def make() -> Accelerator:
        reset_state()
        # Each residual block its own FSDP group (SIZE_BASED: > 100 parameters), then the root.
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100)
        return Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=accum)
    return make


def check_fsdp2_distill_one_call():
    return equivalence(fsdp2(2), "distill", together=True, accum=2, clip=0.5, save_as="fsdp2")


def check_fsdp2_dpo_separate_calls():
    return equivalence(fsdp2(2), "dpo", together=False, accum=2, clip=0.5, both=True)


def check_fsdp2_exact_resume():
    return exact_resume(fsdp2(), "fsdp2-resume", "distill", together=False)


# -- DeepSpeed ----------------------------------------------------------------------------------
def _ds_plugin(stage: int, accum: int = 2, clip: float = 0.5) -> Any:
    from hasten.utils.deepspeed_plugin import DeepSpeedPlugin

    return DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=accum, gradient_clipping=clip)


def ds_two_plugins(accum: int = 2, clip: float = 0.5) -> Callable[[], Accelerator]:
    """A ZeRO-2 student plugin and a ZeRO-3 teacher plugin (no optimizer: inference), Accelerate's names."""
    def make() -> Accelerator:
        reset_state()
        return Accelerator(deepspeed_plugins={"student": _ds_plugin(2, accum, clip),
                                              "teacher": _ds_plugin(3, accum, clip)})
    return make


def ds_one_plugin(stage: int, accum: int = 2, clip: float = 0.5) -> Callable[[], Accelerator]:
    def make() -> Accelerator:
        reset_state()
        return Accelerator(deepspeed_plugin=_ds_plugin(stage, accum, clip))
    return make


def check_deepspeed_plugins_select():
    """The first plugin is active; selecting another makes it the active one everywhere it is read."""
    from hasten.utils import get_active_deepspeed_plugin

    acc = ds_two_plugins()()
    student, teacher = acc.state.get_deepspeed_plugin("student"), acc.state.get_deepspeed_plugin("teacher")
    assert student.selected and not teacher.selected
    assert get_active_deepspeed_plugin(acc.state) is student and acc.deepspeed_plugin is student
    acc.state.select_deepspeed_plugin("teacher")
    assert teacher.selected and not student.selected
    assert get_active_deepspeed_plugin(acc.state) is teacher and acc.deepspeed_plugin is teacher
    assert acc.state.deepspeed_plugins == {"student": student, "teacher": teacher}
    try:
        acc.state.select_deepspeed_plugin("techer")
    except ValueError as e:
        assert "techer" in str(e) and "teacher" in str(e), str(e)
    else:
        raise AssertionError("an unknown plugin name was accepted")
    acc.state.select_deepspeed_plugin("student")
    return sorted(acc.state.deepspeed_plugins)


def check_ds_zero2_student_zero3_teacher():
    """Distillation: student prepared under the ZeRO-2 plugin, teacher under the ZeRO-3 one (partitioned)."""
    return equivalence(ds_two_plugins(), "distill", together=False, accum=2, clip=0.5, select=("student", "teacher"),
                       engines=(2, 3), save_as="ds")


def check_ds_zero3_dpo_one_call():
    return equivalence(ds_one_plugin(3), "dpo", together=True, accum=2, clip=0.5, engines=(3, 3))


def check_ds_exact_resume_zero2_one_call():
    """ZeRO-2 with the reference prepared in the same call: a plain module (no engine) beside the engine."""
    return exact_resume(ds_one_plugin(2, accum=1, clip=1.0), "ds2-resume", "dpo", together=True)


def check_ds_exact_resume_two_plugins():
    return exact_resume(ds_two_plugins(accum=1, clip=1.0), "ds-resume", "distill", together=False,
                        select=("student", "teacher"))
