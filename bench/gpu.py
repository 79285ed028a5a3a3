"""One training loop, three ways: raw PyTorch, hasten and Accelerate, on a Llama-style model.

    python bench/gpu.py                                   # ~0.78B Llama on one GPU, every variant, 3 rounds
    python bench/gpu.py --variants bf16,bf16+compile --rounds 5
    python bench/gpu.py --small --device cpu --steps 2 --variants bf16   # smoke run, any machine

The loop is the same for every framework: a DataLoader with pinned memory (on a GPU), forward,
backward, gradient clipping at 1.0, fused AdamW. Variants: ``bf16``, ``fp16`` (with a gradient
scaler), ``fp8`` (torchao float8 for every Linear but the first and the last, under bf16 autocast),
``bf16+compile`` and ``fp8+compile`` (``torch.compile`` with inductor). hasten and Accelerate get the
same settings through their own options (``mixed_precision``, ``dynamo_backend``, fp8 through
``AORecipeKwargs``).

Every (framework, variant) runs in a process of its own, and the rounds interleave them in a rotating
order, so no variant always runs first, on a cold GPU, or after a long compile. Each process reports
the median step time after the warm-up steps, the peak CUDA memory (``max_memory_allocated``), and
checkpoint figures: a blocking save (raw: ``torch.save`` + fsync; hasten: ``save_state``;
Accelerate: ``save_state``, which does not fsync), hasten's ``save_state(blocking=False)`` until it
returns (the first one allocates the staging buffers, so the second is reported too), and a load
(raw: ``torch.load`` + ``load_state_dict``; the others: ``load_state``). The table gives medians
over rounds and the step-time ratio to raw PyTorch.

Skipped with a message, never failed: Accelerate when it is not installed; fp8 when torchao is not
installed (``pip install torchao``; on a machine without network, build or download the wheel
elsewhere, e.g. ``pip download torchao --no-deps -d wheels/``, carry ``wheels/`` with the checkout
and ``pip install --no-deps wheels/torchao-*.whl``). fp8 needs a GPU with float8 matmuls (compute
capability 8.9 or newer); elsewhere its rows say why it failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("bf16", "fp16", "fp8", "bf16+compile", "fp8+compile")
FRAMEWORKS = ("raw", "hasten", "accelerate")
# ~0.78B parameters (with the untied output layer), fits a GPU of 80 GB with AdamW and batch 4 x 2048.
FULL = dict(hidden=1536, layers=24, heads=12, intermediate=4096, vocab=32000, seq=2048, batch=4)
SMALL = dict(hidden=128, layers=2, heads=4, intermediate=256, vocab=1000, seq=128, batch=2)


# -- the worker: one framework, one variant, one process -------------------------------------------------
def _model(shape: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
                         intermediate_size=shape["intermediate"], vocab_size=shape["vocab"],
                         max_position_embeddings=shape["seq"], tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _loader(shape: dict, batches: int, pin: bool):
    import torch

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (batches * shape["batch"], shape["seq"]), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=shape["batch"],
                                       pin_memory=pin, drop_last=True)


def _fp8_filter(model):
    """Every Linear but the first and the last, and only those whose sizes are multiples of 16
    (the rule hasten's and Accelerate's default filters apply)."""
    import torch

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    keep = set(names[1:-1])

    def accept(module, fqn):
        return (fqn in keep and isinstance(module, torch.nn.Linear)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)
    return accept


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _framework(name: str, precision: str, compiled: bool, device, model, loader):
    """(model, opt, loader, backward, clip, checkpoint functions) for one framework."""
    import torch

    if name == "raw":
        model = model.to(device)
        if precision == "fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(model, config=Float8LinearConfig(pad_inner_dim=True),
                                       module_filter_fn=_fp8_filter(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        runner = torch.compile(model) if compiled else model
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

        def forward(batch):
            with torch.autocast(device.type, dtype=dtype):
                return runner(input_ids=batch, labels=batch).loss

        def backward(loss):
            (scaler.scale(loss) if scaler else loss).backward()

        def step():
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)

        def save(folder, blocking=True):
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, "state.pt")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            _fsync(path)

        def load(folder):
            state = torch.load(os.path.join(folder, "state.pt"), map_location=device, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])

        return loader, forward, backward, step, save, load, None

    if name == "hasten":
        import hasten as lib
        from hasten.utils import AORecipeKwargs
    else:
        import accelerate as lib
        from accelerate.utils import AORecipeKwargs
    kwargs = {"mixed_precision": precision, "cpu": device.type == "cpu"}
    if precision == "fp8":
        kwargs["kwargs_handlers"] = [AORecipeKwargs()]
    if compiled:
        kwargs["dynamo_backend"] = "inductor"
    acc = lib.Accelerator(**kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt, loader = acc.prepare(model, opt, loader)

    def forward(batch):
        return model(input_ids=batch, labels=batch).loss

    def step():
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def save(folder, blocking=True):
        if blocking:
            acc.save_state(folder)
        else:
            acc.save_state(folder, blocking=False)

    return loader, forward, acc.backward, step, save, acc.load_state, acc


def worker(job: dict) -> dict:
    import torch

    device = torch.device(job["device"])
    shape = job["shape"]
    precision, _, compiled = job["variant"].partition("+")
    out: dict = {"framework": job["framework"], "variant": job["variant"]}
    model = _model(shape)
    out["params"] = sum(p.numel() for p in model.parameters())
    total = job["warmup"] + job["steps"]
    loader = _loader(shape, total, pin=device.type == "cuda")
    loader, forward, backward, step, save, load, acc = _framework(job["framework"], precision, bool(compiled),
                                                                  device, model, loader)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i, (batch,) in enumerate(loader):
        if i == total:
            break
        batch = batch.to(device, non_blocking=True)
        _sync(device)
        start = time.perf_counter()
        loss = forward(batch)
        backward(loss)
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    out["loss"] = float(loss)
    out["ms_per_step"] = statistics.median(times[job["warmup"]:]) * 1000
    out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if job["checkpoint"]:
        base = tempfile.mkdtemp(prefix="hasten-bench-gpu-", dir=job["dir"])
        try:
            out.update(_checkpoint(job, save, load, acc, base, device))
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return out


def _checkpoint(job: dict, save, load, acc, base: str, device) -> dict:
    out = {}
    _sync(device)
    os.sync()
    start = time.perf_counter()
    save(os.path.join(base, "blocking"))
    out["save_s"] = time.perf_counter() - start
    if job["framework"] == "hasten":
        returns = []
        for i in range(2):  # the first allocates the staging buffers; later ones reuse them
            os.sync()
            start = time.perf_counter()
            save(os.path.join(base, f"background{i}"), blocking=False)
            returns.append(time.perf_counter() - start)
            acc.wait_for_checkpoint()
        out["background_return_s"] = returns
    os.sync()
    start = time.perf_counter()
    load(os.path.join(base, "blocking"))
    _sync(device)
    out["load_s"] = time.perf_counter() - start
    return out


# -- the parent: plan, run interleaved, report ---------------------------------------------------------------
def _versions(device: str) -> str:
    import torch

    from importlib import metadata

    parts = [f"torch {torch.__version__}"]
    for name in ("transformers", "hasten", "accelerate", "torchao"):  # read, not imported (torchao is slow to import)
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else device
    return f"{where}; " + ", ".join(parts)


def plan(args) -> tuple[list[dict], list[str]]:
    """The jobs to run and the messages about what is skipped."""
    notes = []
    frameworks = [f for f in args.frameworks.split(",") if f]
    variants = [v for v in args.variants.split(",") if v]
    for name in frameworks + variants:
        if name not in FRAMEWORKS + VARIANTS:
            raise SystemExit(f"bench/gpu.py: unknown framework or variant {name!r}; frameworks: {', '.join(FRAMEWORKS)}; "
                             f"variants: {', '.join(VARIANTS)}")
    if importlib.util.find_spec("transformers") is None:
        raise SystemExit("bench/gpu.py builds its model from transformers.LlamaConfig: pip install transformers")
    if "accelerate" in frameworks and importlib.util.find_spec("accelerate") is None:
        frameworks.remove("accelerate")
        notes.append("Accelerate is not installed: its rows are skipped (pip install accelerate)")
    if any(v.startswith("fp8") for v in variants) and importlib.util.find_spec("torchao") is None:
        variants = [v for v in variants if not v.startswith("fp8")]
        notes.append("torchao is not installed: the fp8 variants are skipped (pip install torchao; see this "
                     "script's docstring for a machine without network)")
    shape = SMALL if args.small else FULL
    jobs = [dict(framework=f, variant=v, shape=shape, device=args.device, steps=args.steps, warmup=args.warmup,
                 checkpoint=not args.no_checkpoint, dir=args.dir) for v in variants for f in frameworks]
    return jobs, notes


def run_job(job: dict, timeout: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return {"error": f"exit status {proc.returncode}: {lines[-1] if lines else 'no output'}"}


def summarize(jobs: list[dict], results: dict) -> list[str]:
    """Markdown table rows: medians over rounds, ratio of step time to raw PyTorch's."""
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def fmt(value, spec):
        return "—" if value is None else format(value, spec)

    rows = ["| variant | framework | ms/step | × raw | peak GiB | save s | background return s (1st / next) | load s |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for job in jobs:
        key = (job["framework"], job["variant"])
        runs = results[key]
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            rows.append(f"| {job['variant']} | {job['framework']} | failed: {errors[0][:120]} | | | | | |")
            continue
        ms = median([r["ms_per_step"] for r in runs])
        raw = [r for r in results.get(("raw", job["variant"]), []) if "error" not in r]
        raw_ms = median([r["ms_per_step"] for r in raw]) if raw else None
        ratio = ms / raw_ms if raw_ms else None
        background = [r["background_return_s"] for r in runs if "background_return_s" in r]
        back = (f"{median([b[0] for b in background]):.3f} / {median([b[1] for b in background]):.3f}"
                if background else "—")
        rows.append(f"| {job['variant']} | {job['framework']} | {ms:.1f} | {fmt(ratio, '.3f')} | "
                    f"{fmt(median([r['peak_gib'] for r in runs]), '.2f')} | {fmt(median([r.get('save_s') for r in runs]), '.3f')} | "
                    f"{back} | {fmt(median([r.get('load_s') for r in runs]), '.3f')} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--small", action="store_true", help="a tiny Llama (seconds per process) instead of ~0.78B")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated, from raw, hasten, accelerate")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens there)")
    parser.add_argument("--rounds", type=int, default=3, help="each (framework, variant) runs once per round")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip the save/load timings")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed to one process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        try:
            result = worker(job)
        except Exception as e:  # noqa: BLE001 - the parent prints it in the table
            result = {"error": f"{type(e).__name__}: {e}".replace("\n", " ")}
        print(json.dumps(result), flush=True)
        return
    jobs, notes = plan(args)
    for note in notes:
        print(f"note: {note}")
    if not jobs:
        raise SystemExit("bench/gpu.py: nothing to run")
    print(_versions(args.device))
    shape = jobs[0]["shape"]
    print(f"model: Llama, hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} heads, intermediate "
          f"{shape['intermediate']}, vocab {shape['vocab']}; batch {shape['batch']} x {shape['seq']} tokens; "
          f"{args.steps} timed steps after {args.warmup}, {args.rounds} rounds", flush=True)
    results: dict = {(j["framework"], j["variant"]): [] for j in jobs}
    for r in range(args.rounds):
        order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
        for job in order:
            result = run_job(job, args.timeout)
            results[(job["framework"], job["variant"])].append(result)
            what = result.get("error") or f"{result['ms_per_step']:.1f} ms/step"
            print(f"round {r + 1}: {job['framework']:10s} {job['variant']:13s} {what}", flush=True)
    params = next((r["params"] for runs in results.values() for r in runs if "params" in r), None)
    if params:
        print(f"parameters: {params / 1e9:.3f} B")
    print("\n".join(summarize(jobs, results)))


if __name__ == "__main__":
    main()
