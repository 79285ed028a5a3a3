"""fp16 gradient scaling with several optimizers, and without per-step host syncs (issue 24, items 1 and 7).

The reference is a hand-written ``torch.amp.GradScaler`` loop: one ``update()`` per iteration,
after every optimizer stepped, and each optimizer's gradients unscaled exactly once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hasten import Accelerator, GradScalerKwargs

_SCALER = dict(init_scale=1024.0, growth_interval=2)
_STEPS = 5


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=g) for _ in range(_STEPS)]


def _losses(gen: torch.nn.Module, disc: torch.nn.Module, x: torch.Tensor, run) -> tuple[torch.Tensor, torch.Tensor]:
    fake = run(gen, x)
    loss_g = -run(disc, fake).mean()
    loss_d = run(disc, fake.detach()).pow(2).mean() + run(disc, x).sub(1).pow(2).mean()
    return loss_g, loss_d


def _reference_gan(ref_gen, ref_disc, batches) -> tuple:
    """torch's own fp16 GAN loop (D clipped, one scaler update per iteration): its scaler, and the scale
    after each iteration."""
    def run(m, x):
        with torch.autocast("cpu", dtype=torch.float16):  # cpu-on-purpose: compared with Accelerator(cpu=True)
            return m(x).float()

    ref_g = torch.optim.SGD(ref_gen.parameters(), lr=0.1)
    ref_d = torch.optim.SGD(ref_disc.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **_SCALER)
    scales = []
    for x in batches:
        _, loss_d = _losses(ref_gen, ref_disc, x, run)
        scaler.scale(loss_d).backward()
        scaler.unscale_(ref_d)
        torch.nn.utils.clip_grad_norm_(ref_disc.parameters(), 1.0)
        scaler.step(ref_d)
        ref_d.zero_grad()
        loss_g, _ = _losses(ref_gen, ref_disc, x, run)
        scaler.scale(loss_g).backward()
        scaler.step(ref_g)
        scaler.update()
        ref_g.zero_grad()
        ref_d.zero_grad()
        scales.append(scaler.get_scale())
    return scaler, scales


def _reference(gen, disc, batches):
    """The GAN step as torch documents it for several optimizers, with ``GradScaler`` by hand."""
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **_SCALER)

    def run(m, x):
        with torch.autocast("cpu", dtype=torch.float16):  # cpu-on-purpose: compared with Accelerator(cpu=True)
            return m(x).float()

    scales = []
    for x in batches:
        loss_g, loss_d = _losses(gen, disc, x, run)
        scaler.scale(loss_g).backward(retain_graph=True)
        opt_d.zero_grad()  # D is trained on its own loss only
        scaler.scale(loss_d).backward()
        scaler.unscale_(opt_g)
        scaler.unscale_(opt_d)
        torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
        scaler.step(opt_g)
        scaler.step(opt_d)
        scaler.update()
        opt_g.zero_grad()
        opt_d.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_two_optimizers_match_a_hand_written_grad_scaler_loop(fresh_state):
    gen, disc = _models()
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    batches = _batches()
    ref_scales = _reference(ref_gen, ref_disc, batches)

    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**_SCALER)])
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    gen, disc, opt_g, opt_d = acc.prepare(gen, disc, opt_g, opt_d)
    scales = []
    for x in batches:
        loss_g, loss_d = _losses(gen, disc, x, lambda m, t: m(t))
        acc.backward(loss_g, retain_graph=True)
        opt_d.zero_grad()
        acc.backward(loss_d)
        acc.clip_grad_norm_(gen.parameters(), 1.0)
        opt_g.step()
        opt_d.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        scales.append(acc.scaler.get_scale())
    assert scales == ref_scales  # one update per iteration: the scale grows at torch's rate
    for mine, ref in ((gen, ref_gen), (disc, ref_disc)):
        for p, q in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


class _HostReads(TorchFunctionMode):
    """Counts tensor methods that copy a value to the host (each one is a device sync on CUDA)."""

    _READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self._READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _fused_step(step) -> list[str]:
    with _HostReads() as reads:
        step()
    return reads.calls


def test_fused_optimizer_step_reads_nothing_from_the_device(fresh_state):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ref_model = copy.deepcopy(model)
    x = torch.randn(4, 8)

    # torch's own scaler path for a fused optimizer is sync-free: the baseline this must match.
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with torch.autocast("cpu", dtype=torch.float16):  # cpu-on-purpose: compared with Accelerator(cpu=True)
        loss = ref_model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    assert _fused_step(lambda: (scaler.step(ref_opt), scaler.update())) == []

    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(x).pow(2).mean())
    assert _fused_step(opt.step) == []
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_skipped_step_is_still_reported_when_read(fresh_state):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(model(torch.randn(2, 4)).sum())
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.step_was_skipped
    assert acc.scaler.get_scale() == 512.0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    opt.zero_grad()
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    assert not opt.step_was_skipped


def test_interleaved_backward_and_step_unscale_each_optimizer_once(fresh_state):
    """D's backward and step, then G's (the usual GAN loop): one ``update()`` per iteration after both
    stepped, torch's rule (it used to update after D's step as well: the scale grew twice as fast),
    and the scale each loss was scaled with is the one its gradients are unscaled with."""
    gen, disc = _models()
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    batches = _batches()

    _, ref_scales = _reference_gan(ref_gen, ref_disc, batches)

    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**_SCALER)])
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    gen, disc, opt_g, opt_d = acc.prepare(gen, disc, opt_g, opt_d)
    scales = []
    for x in batches:
        _, loss_d = _losses(gen, disc, x, lambda m, t: m(t))
        acc.backward(loss_d)
        acc.clip_grad_norm_(disc.parameters(), 1.0)
        opt_d.step()
        opt_d.zero_grad()
        loss_g, _ = _losses(gen, disc, x, lambda m, t: m(t))
        acc.backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        scales.append(acc.scaler.get_scale())
    assert scales == ref_scales
    for mine, ref in ((gen, ref_gen), (disc, ref_disc)):
        for p, q in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_a_due_update_is_in_the_saved_scaler_state(fresh_state):
    """Two prepared optimizers, one stepped: the update waits until the iteration is known to have
    ended (that optimizer steps again), but a checkpoint taken now holds the updated scale, as a
    hand-written loop's ``update()`` would."""
    torch.manual_seed(0)
    model, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ref = copy.deepcopy(model)
    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=1)])
    model, opt, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1))
    x = torch.randn(2, 4)
    acc.backward(model(x).sum())
    opt.step()

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):  # cpu-on-purpose: compared with Accelerator(cpu=True)
        scaler.scale(ref(x).float().sum()).backward()
    scaler.step(ref_opt)
    scaler.update()
    assert acc.precision.state_dict() == scaler.state_dict()
    acc.backward(model(x).sum())  # the next loss (it may be another optimizer's, in the same iteration)
    assert acc.precision.state_dict() == scaler.state_dict()


def test_an_optimizer_stepping_every_other_iteration_matches_update_per_iteration(fresh_state):
    """A steps every iteration, B every second one; the hand-written loop updates at the end of each
    iteration. hasten learns that an iteration ended when A steps again: the weights and the scale a
    checkpoint holds equal the hand-written loop's after every iteration."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    kw = dict(init_scale=1024.0, growth_interval=1)  # the scale changes at every update: a late one shows
    batches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    scaler = torch.amp.GradScaler("cpu", **kw)
    ref_oa, ref_ob = torch.optim.SGD(ref_a.parameters(), lr=0.1), torch.optim.SGD(ref_b.parameters(), lr=0.1)
    ref_states = []
    for i, x in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):  # cpu-on-purpose: compared with Accelerator(cpu=True)
            loss = ref_b(ref_a(x)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(ref_oa)
        if i % 2 == 0:
            scaler.step(ref_ob)
        scaler.update()
        ref_oa.zero_grad()
        ref_ob.zero_grad()
        ref_states.append(scaler.state_dict())

    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**kw)])
    a, b, oa, ob = acc.prepare(a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1))
    for i, x in enumerate(batches):
        acc.backward(b(a(x)).pow(2).mean())
        oa.step()
        if i % 2 == 0:
            ob.step()
        oa.zero_grad()
        ob.zero_grad()
        assert acc.precision.state_dict() == ref_states[i], i
    for mine, ref in ((a, ref_a), (b, ref_b)):
        for p, q in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def _sync_free(step) -> bool:
    """Whether ``step()`` runs with CUDA's sync debug mode set to raise on any host sync."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return True
    except RuntimeError as err:
        if "synchroniz" not in str(err).lower():
            raise
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
def test_fused_adamw_fp16_step_has_no_host_sync_on_cuda(fresh_state):
    """The GPU form of the host-read test: a second fused AdamW step under ``set_sync_debug_mode``."""
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(64, 64).cuda()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(8, 64, device="cuda")
    for _ in range(2):  # the first step builds the optimizer state
        ref_opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            scaler.scale(ref_model(x).float().pow(2).mean()).backward()
        steps_clean = _sync_free(lambda: (scaler.step(ref_opt), scaler.update()))
    if not steps_clean:
        pytest.skip("torch's own fused scaler step syncs in this torch build")

    acc = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(64, 64)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    for _ in range(2):
        opt.zero_grad()
        acc.backward(model(x).pow(2).mean())
        clean = _sync_free(opt.step)
    assert clean
    assert not opt.step_was_skipped  # the verdict is still there when read


def test_unscaling_every_optimizer_before_the_other_has_gradients(fresh_state):
    """``accelerator.unscale_gradients()`` (every optimizer) before D's clip, while G holds no gradients
    yet: G's later step unscales its own gradients once, and the run equals the hand-written loop."""
    gen, disc = _models()
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    batches = _batches()

    scaler, _ = _reference_gan(ref_gen, ref_disc, batches)

    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**_SCALER)])
    gen, disc, opt_g, opt_d = acc.prepare(gen, disc, torch.optim.SGD(gen.parameters(), lr=0.1),
                                          torch.optim.SGD(disc.parameters(), lr=0.1))
    for x in batches:
        _, loss_d = _losses(gen, disc, x, lambda m, t: m(t))
        acc.backward(loss_d)
        acc.unscale_gradients()
        torch.nn.utils.clip_grad_norm_(disc.parameters(), 1.0)
        opt_d.step()
        opt_d.zero_grad()
        loss_g, _ = _losses(gen, disc, x, lambda m, t: m(t))
        acc.backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
    assert acc.precision.state_dict() == scaler.state_dict()
    for mine, ref in ((gen, ref_gen), (disc, ref_disc)):
        for p, q in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
