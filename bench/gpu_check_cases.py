"""The checks of ``bench/gpu_check.py``, in the order they run: cheapest and most likely to break first.

Each check uses hasten as a user would (``Accelerator``, ``prepare``, ``save_state``...) and returns a
one-line detail (PASS), raises ``Skip`` (the machine lacks something), ``AssertionError`` (FAIL: the
behaviour is wrong) or anything else (ERROR: the check broke). With ``Context.dry_run`` the same code
runs on CPU with small sizes, and claims that only a GPU can judge (memory, host syncs, speed) are
reported, not asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


class Skip(Exception):
    """The machine lacks what the check needs; the message says what."""


@dataclass
class Context:
    dry_run: bool
    facts: dict = field(default_factory=dict)
    budget_s: float = float(os.environ.get("GPU_CHECK_BUDGET_S", "600"))  # this check's, set by the runner
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        """Seconds of this check's budget still left."""
        return self.budget_s - (time.perf_counter() - self.started)

    @property
    def device(self):
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")

    def size(self, gpu: int, dry: int) -> int:
        return dry if self.dry_run else gpu


@dataclass
class Check:
    name: str
    budget_s: float
    summary: str
    function: Callable[[Context], str]
    needs: tuple = ()  # of "torchao", "fp8_gpu", "transformers", "pytest", "gpu_only"

    def missing(self, facts: dict, dry_run: bool) -> Optional[str]:
        """Why this check cannot run on this machine, or None."""
        if facts.get("torch") is None:
            return f"torch does not import: {facts.get('torch_error')}"
        if not dry_run and not facts.get("cuda"):
            return "no CUDA device (torch.cuda.is_available() is False" + (
                f": {facts['cuda_error']})" if facts.get("cuda_error") else ")") + "; --cpu-dry-run runs the code paths"
        if "gpu_only" in self.needs and dry_run:
            return "only meaningful on a GPU (the CPU test suite covers this on CPU)"
        for module in ("torchao", "transformers", "pytest"):
            if module in self.needs and not facts.get(module):
                return f"{module} is not installed (pip install {module}; offline: carry its wheel)"
        if "fp8_gpu" in self.needs and not dry_run and tuple(facts.get("capability") or (0, 0)) < (8, 9):
            return f"fp8 matmuls need compute capability 8.9 or newer; this GPU has {facts.get('capability')}"
        return None


CHECKS: dict[str, Check] = {}


def check(budget_s: float, summary: str, needs: tuple = ()) -> Callable:
    def register(function: Callable[[Context], str]) -> Callable[[Context], str]:
        name = function.__name__.removeprefix("check_")
        CHECKS[name] = Check(name, budget_s, summary, function, needs)
        return function
    return register


# -- helpers ------------------------------------------------------------------------------------
def reset_hasten() -> None:
    """Forget hasten's process state and tear down a process group, as a new process would start."""
    try:
        import torch.distributed as dist

        from hasten.state import AcceleratorState, GradientState

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    except Exception:  # noqa: BLE001 - best effort between checks
        pass


def mlp(width: int, depth: int, seed: int = 0):
    """``depth`` Linear(width, width) with ReLU between: the model of most checks (built on CPU)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list = []
    for i in range(depth):
        layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


def blocks(width: int, depth: int):
    """A stack of identical residual blocks in a ModuleList: what regional compilation and FSDP2 wrap."""
    import torch
    from torch import nn

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                        for _ in range(depth))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    torch.manual_seed(0)
    return Blocks()


def train(acc, model, opt, width: int, steps: int, batch: int = 8, seed: int = 1) -> float:
    import torch

    g = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(batch, width, generator=g).to(acc.device)
        loss = model(x).float().pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def full_weights(acc, model) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in acc.get_state_dict(model).items()}  # cpu-on-purpose


def differing(a: dict, b: dict) -> list:
    import torch

    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def fsdp_plugin(**kwargs):
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, **kwargs)


def allocated() -> int:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def reset_peak() -> int:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return allocated()


def peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


# -- the checks ---------------------------------------------------------------------------------
@check(60, "every API the checks use imports; the GPU, torch, torchao")
def check_imports(ctx: Context) -> str:
    import torch

    import hasten
    from hasten import Accelerator  # noqa: F401
    from hasten.commands import _heartbeat, hangs  # noqa: F401
    from hasten.compilation import compile_regions  # noqa: F401
    from hasten.utils import AORecipeKwargs, TorchDynamoPlugin  # noqa: F401
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin  # noqa: F401
    from hasten.utils.other import has_compiled_regions  # noqa: F401

    ao = "not installed"
    if ctx.facts.get("torchao"):
        import torchao

        ao = torchao.__version__
    where = "CPU (dry run)" if ctx.dry_run else f"{torch.cuda.get_device_name(0)}"
    return f"hasten {hasten.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), torchao {ao}, {where}"


@check(45, "a cuda:nccl,cpu:gloo group (as with CPU offload): all_reduce, the hang reporter reads the flight recorder")
def check_flight_recorder(ctx: Context) -> str:
    import torch
    import torch.distributed as dist

    from hasten.commands import _heartbeat, hangs

    folder = tempfile.mkdtemp(prefix="gpu-check-fr-")
    os.environ.update(hangs.child_env(folder, "cpu" if ctx.dry_run else "cuda"))  # before the group: torch reads them
    backend = "cpu:gloo" if ctx.dry_run else "cuda:nccl,cpu:gloo"
    store = dist.FileStore(os.path.join(folder, "store"), 1)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    try:
        tensor = torch.ones(1024, device=ctx.device)
        dist.all_reduce(tensor)
        dist.all_reduce(torch.ones(8))  # the gloo half of the group
        if not ctx.dry_run:
            torch.cuda.synchronize()
        shown = str(dist.get_backend())
        assert _heartbeat.uses_nccl(shown) != ctx.dry_run, f"uses_nccl({shown!r}) is wrong"
        data = _heartbeat._flight_recorder()
        assert data, f"no flight recorder dump for backend {shown!r}"
        path = os.path.join(folder, "fr0.json")
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else str(data).encode())
        fr = hangs._load_fr({"fr": path})
        entries = (fr or {}).get("entries") or []
        ops = [hangs._op_text(e) for e in entries]
        assert any("all_reduce" in op and "[1024]" in op for op in ops), f"the reader found {ops} in {shown!r}'s record"
        return f"backend {shown}: the reader parsed {len(entries)} record(s): {', '.join(ops[:3])}"
    finally:
        dist.destroy_process_group()


@check(90, "FSDP2 + CPU offload on one process: GPU memory after prepare is far below the model "
           "(also with cpu_ram_efficient_loading)")
def check_fsdp2_offload_memory(ctx: Context) -> str:
    import torch

    from hasten import Accelerator

    width, depth = ctx.size(4096, 64), 8
    model_bytes = width * (width + 1) * 4 * depth
    lines = []
    for options in ({"cpu_offload": True}, {"cpu_offload": True, "cpu_ram_efficient_loading": True}):
        reset_hasten()
        base = reset_peak()
        acc = Accelerator(fsdp_plugin=fsdp_plugin(**options))
        model = mlp(width, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        after_prepare = peak() - base
        train(acc, model, opt, width, steps=1)
        after_step = peak() - base
        on_cpu = all(p.to_local().device.type == "cpu" if hasattr(p, "to_local") else p.device.type == "cpu"
                     for p in model.parameters())
        assert on_cpu, f"{options}: the sharded parameters are not in host memory"
        lines.append(f"{options}: peak after prepare {after_prepare / MiB:.0f} MiB, after a step "
                     f"{after_step / MiB:.0f} MiB (model {model_bytes / MiB:.0f} MiB)")
        if not ctx.dry_run:
            assert after_prepare < 0.25 * model_bytes, f"FSDP2 placed the model on the GPU before sharding: {lines[-1]}"
    return "; ".join(lines)


@check(60, "plain background save: returns fast, 3 more steps, reload equals the state at save time; "
           "the second save reuses the staging buffers")
def check_background_save(ctx: Context) -> str:
    import torch

    from hasten import Accelerator

    width = ctx.size(4096, 64)
    acc = Accelerator(cpu=ctx.dry_run)
    model = mlp(width, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not ctx.dry_run)
    model, opt = acc.prepare(model, opt)
    train(acc, model, opt, width, steps=1)
    folder = tempfile.mkdtemp(prefix="gpu-check-save-")
    returned, clones, storages = [], [], []
    for i in range(2):
        clones.append(full_weights(acc, model))
        start = time.perf_counter()
        acc.save_state(os.path.join(folder, str(i)), blocking=False)
        returned.append(time.perf_counter() - start)
        train(acc, model, opt, width, steps=3, seed=10 + i)  # changes the weights while the save writes
        acc.wait_for_checkpoint()
        stager = getattr(getattr(getattr(acc, "_checkpoints", None), "background", None), "stager", None)
        buffers = stager.buffers if stager is not None else {}
        storages.append({t.untyped_storage().data_ptr() for t in buffers.values()})
    for i, clone in enumerate(clones):
        acc.load_state(os.path.join(folder, str(i)))
        wrong = differing(full_weights(acc, model), clone)
        assert not wrong, f"save {i}: the reload differs from the weights at save time in {wrong[:4]}"
    reused = bool(storages[0]) and storages[0] == storages[1]
    assert reused or not storages[0], "the second save allocated new staging buffers"
    acc.free_memory()
    return (f"save_state(blocking=False) returned in {returned[0] * 1e3:.0f} ms (first) and "
            f"{returned[1] * 1e3:.0f} ms (second); reloads bitwise; staging buffers "
            f"{'reused' if reused else 'not inspectable'}")


@check(75, "one-process FSDP2: save_state(blocking=False) every 3 steps while training, each reloads bitwise")
def check_fsdp2_background_save(ctx: Context) -> str:
    import torch

    from hasten import Accelerator

    width = ctx.size(2048, 64)
    acc = Accelerator(cpu=ctx.dry_run, fsdp_plugin=fsdp_plugin())
    model = mlp(width, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    folder = tempfile.mkdtemp(prefix="gpu-check-fsdp-save-")
    clones = []
    for i in range(3):
        train(acc, model, opt, width, steps=3, seed=i)
        clones.append(full_weights(acc, model))
        acc.save_state(os.path.join(folder, str(i)), blocking=False)
    train(acc, model, opt, width, steps=2, seed=9)
    acc.wait_for_checkpoint()
    for i, clone in enumerate(clones):
        acc.load_state(os.path.join(folder, str(i)))
        wrong = differing(full_weights(acc, model), clone)
        assert not wrong, f"save {i}: the reload differs in {wrong[:4]}"
    return f"{len(clones)} background saves during training, each reloaded bitwise"


@check(60, "load_state into CUDA tensors larger than 64 MiB, with AdamW state, bitwise")
def check_load_large(ctx: Context) -> str:
    import torch
    from torch import nn

    from hasten import Accelerator

    rows = ctx.size(5120, 96)
    folder = tempfile.mkdtemp(prefix="gpu-check-load-")
    saved = {}
    for phase in ("save", "load"):
        reset_hasten()
        acc = Accelerator(cpu=ctx.dry_run)
        torch.manual_seed(0 if phase == "save" else 1)
        model = nn.Sequential(nn.Linear(4096 if not ctx.dry_run else 64, rows), nn.Linear(rows, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        train(acc, model, opt, model[0].in_features, steps=1, seed=0 if phase == "save" else 5)
        if phase == "save":
            acc.save_state(folder)
        else:
            acc.load_state(folder)
        state = {f"model.{k}": v for k, v in full_weights(acc, model).items()}
        for index, per_param in opt.state_dict()["state"].items():
            state.update({f"opt.{index}.{k}": torch.as_tensor(v).to("cpu", copy=True)  # cpu-on-purpose
                          for k, v in per_param.items()})
        saved[phase] = state
    biggest = model[0].weight.numel() * 4
    wrong = differing(saved["save"], saved["load"])
    assert not wrong, f"load_state differs from what was saved in {wrong[:4]}"
    return f"weights and AdamW state bitwise after load_state (largest tensor {biggest / MiB:.0f} MiB)"


@check(60, "fp16 + fused AdamW: no host sync in backward/step (set_sync_debug_mode); two optimizers "
           "match a hand-written GradScaler loop")
def check_fp16(ctx: Context) -> str:
    import torch

    from hasten import Accelerator

    width = ctx.size(1024, 32)
    acc = Accelerator(cpu=ctx.dry_run, mixed_precision="fp16")
    model = mlp(width, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = acc.prepare(model, opt)
    train(acc, model, opt, width, steps=2)  # warm-up: lazy state, first scale
    x = torch.randn(8, width, device=acc.device)
    caught: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not ctx.dry_run:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                acc.backward(model(x).float().pow(2).mean())
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            if not ctx.dry_run:
                torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, f"{len(syncs)} host syncs in 3 fp16 steps, first: {syncs[0]}"
    gap = _two_optimizers(ctx, width)
    assert gap <= 1e-6, f"two optimizers: hasten's updates differ from a GradScaler loop's by up to {gap:.3g}"
    return "0 host syncs in 3 fp16 steps with fused AdamW; two-optimizer loop equals GradScaler's"


def _two_optimizers(ctx: Context, width: int) -> float:
    """A GAN-style loop (clip G, step G, step D) through hasten and by hand; the largest weight difference."""
    import torch

    from hasten import Accelerator

    def loop(use_hasten: bool):
        reset_hasten()
        acc = Accelerator(cpu=ctx.dry_run, mixed_precision="fp16") if use_hasten else None
        gen, disc = mlp(width, 2, seed=3).to(ctx.device), mlp(width, 2, seed=4).to(ctx.device)
        opt_g, opt_d = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (gen, disc))
        scaler = None if use_hasten else torch.amp.GradScaler(ctx.device.type)
        if use_hasten:
            gen, disc, opt_g, opt_d = acc.prepare(gen, disc, opt_g, opt_d)
        g = torch.Generator().manual_seed(7)
        for _ in range(3):
            x = torch.randn(8, width, generator=g).to(ctx.device)
            with torch.autocast(ctx.device.type, dtype=torch.float16, enabled=not use_hasten):
                loss_g = gen(x).float().pow(2).mean()
            if use_hasten:
                acc.backward(loss_g)
                acc.clip_grad_norm_(gen.parameters(), 1.0)
                opt_g.step()
            else:
                scaler.scale(loss_g).backward()
                scaler.unscale_(opt_g)
                torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
                scaler.step(opt_g)
            with torch.autocast(ctx.device.type, dtype=torch.float16, enabled=not use_hasten):
                loss_d = disc(x).float().pow(2).mean()
            if use_hasten:
                acc.backward(loss_d)
                opt_d.step()
            else:
                scaler.scale(loss_d).backward()
                scaler.step(opt_d)
                scaler.update()
            opt_g.zero_grad()
            opt_d.zero_grad()
        return [p.detach().float().cpu() for m in (gen, disc) for p in m.parameters()]  # cpu-on-purpose

    ours, theirs = loop(True), loop(False)
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs))


@check(120, "inductor + bf16: 0 graph breaks, fp32 outputs, trains")
def check_compile_bf16(ctx: Context) -> str:
    import torch
    from torch._dynamo.utils import counters

    from hasten import Accelerator

    width = ctx.size(1024, 32)
    acc = Accelerator(cpu=ctx.dry_run, mixed_precision="bf16", dynamo_backend="eager" if ctx.dry_run else "inductor")
    model = mlp(width, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    counters.clear()
    out = model(torch.randn(8, width, device=acc.device))
    breaks = sum(counters["graph_break"].values())
    assert out.dtype == torch.float32, f"the compiled bf16 model returned {out.dtype}, not float32"
    assert breaks == 0, f"{breaks} graph breaks: {dict(counters['graph_break'])}"
    loss = train(acc, model, opt, width, steps=2)
    assert loss == loss, "the loss is NaN"
    return f"0 graph breaks, float32 outputs, 2 steps (loss {loss:.4g})"


@check(120, "regional compilation (TorchDynamoPlugin(use_regional_compilation=True)) + FSDP2 on one process")
def check_regional_compile_fsdp2(ctx: Context) -> str:
    import torch

    from hasten import Accelerator
    from hasten.utils import TorchDynamoPlugin
    from hasten.utils.other import has_compiled_regions

    width = ctx.size(1024, 32)
    plugin = TorchDynamoPlugin(backend="eager" if ctx.dry_run else "inductor", use_regional_compilation=True)
    acc = Accelerator(cpu=ctx.dry_run, mixed_precision="bf16", fsdp_plugin=fsdp_plugin(), dynamo_plugin=plugin)
    model = blocks(width, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    assert has_compiled_regions(model), "no block was compiled"
    first = train(acc, model, opt, width, steps=1)
    last = train(acc, model, opt, width, steps=3, seed=1)
    assert last == last and last < first * 1.5, f"loss {first:.4g} -> {last:.4g}"
    return f"blocks compiled in place under FSDP2, loss {first:.4g} -> {last:.4g}"


@check(150, "torchao fp8 on a 4096-wide MLP: float8 layers compiled, no recompiles, faster than bf16 eager",
       needs=("torchao", "fp8_gpu"))
def check_fp8(ctx: Context) -> str:
    import torch
    import torch._dynamo

    from hasten import Accelerator
    from hasten.utils import AORecipeKwargs

    width, batch, steps = ctx.size(4096, 64), ctx.size(8192, 16), ctx.size(10, 2)
    timings = {}
    for precision in ("bf16", "fp8"):
        reset_hasten()
        torch._dynamo.reset()
        handlers = [AORecipeKwargs(auto_compile=False)] if ctx.dry_run and precision == "fp8" else (
            [AORecipeKwargs()] if precision == "fp8" else [])
        acc = Accelerator(cpu=ctx.dry_run, mixed_precision=precision, kwargs_handlers=handlers)
        model = mlp(width, 6)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not ctx.dry_run)
        model, opt = acc.prepare(model, opt)
        if precision == "fp8":
            float8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
            assert float8, "no Linear was converted to float8"
            compiled = [m for m in float8 if getattr(m, "_compiled_call_impl", None) is not None]
            assert ctx.dry_run or compiled, f"{len(float8)} float8 layers, none compiled"
        train(acc, model, opt, width, steps=2, batch=batch)  # warm-up: compiles
        torch._dynamo.config.error_on_recompile = True  # a recompile from here on raises
        try:
            times = []
            for i in range(steps):
                if not ctx.dry_run:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                train(acc, model, opt, width, steps=1, batch=batch, seed=i)
                if not ctx.dry_run:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        finally:
            torch._dynamo.config.error_on_recompile = False
        timings[precision] = statistics.median(times)
    text = (f"{len(float8)} float8 layers ({len(compiled)} compiled), no recompiles; step "
            f"{timings['fp8'] * 1e3:.1f} ms fp8 vs {timings['bf16'] * 1e3:.1f} ms bf16 (eager, the #17 goal)")
    assert ctx.dry_run or timings["fp8"] < timings["bf16"], f"fp8 is not faster: {text}"
    return text


@check(150, "the suite's device tests on this GPU (FSDP one-process, staging, fp16 scaler, norms, compile)",
       needs=("pytest", "gpu_only"))
def check_suite_cuda_tests(ctx: Context) -> str:
    files = ["tests/test_fsdp_one_process.py", "tests/test_checkpoint_staging.py", "tests/test_fp16_scaler.py",
             "tests/test_grad_norms.py", "tests/test_compile.py"]
    files = [f for f in files if os.path.exists(os.path.join(ROOT, f))]
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                              cwd=ROOT, capture_output=True, text=True, timeout=max(ctx.left() - 5, 1))
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise RuntimeError(f"pytest did not finish within the budget; so far: {partial.strip()[-300:]}") from None
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    assert done.returncode == 0, f"pytest exit {done.returncode}: {last}; " + " / ".join(
        line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))[:600]
    gpus = ctx.facts.get("gpus", 0)
    where = "on GPUs (NCCL)" if gpus >= 2 else "on CPU (gloo): NCCL between ranks needs a second GPU"
    return f"{', '.join(os.path.basename(f) for f in files)}: {last}; the 2-process tests ran {where}"


@check(200, "bench/gpu.py --rounds 1 on the small model, then the full one if time is left",
       needs=("transformers", "gpu_only"))
def check_bench_gpu(ctx: Context) -> str:
    lines = []
    for extra in (["--small"], []):
        try:  # the full model only in what is left of the budget: the small model's line is kept
            done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--rounds", "1",
                                   "--variants", "bf16", *extra], cwd=ROOT, capture_output=True, text=True,
                                  timeout=max(ctx.left() - 5, 1))
        except subprocess.TimeoutExpired:
            lines.append(f"{'small' if extra else 'full'}: not finished within the budget")
            break
        rows = [line for line in done.stdout.splitlines() if line.startswith("| bf16")]
        assert done.returncode == 0, f"bench/gpu.py {' '.join(extra)} exit {done.returncode}: {done.stderr[-400:]}"
        lines.append(f"{'small' if extra else 'full'}: " + " ; ".join(rows))
        print("\n".join(rows), flush=True)
    return " || ".join(lines)
