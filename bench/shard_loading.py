"""Host memory and time to a first step when a transformers checkpoint fills an FSDP2 model on N
CPU processes: load straight into shards vs process 0's broadcast vs Accelerate.

    python bench/shard_loading.py --dir /tmp/shard-bench            # ~2.1 GB model, 2 and 4 processes
    python bench/shard_loading.py --dir /tmp/shard-bench --layers 2 --worlds 2 --rounds 1   # a quick try

The parent writes a float32 Llama-shaped checkpoint (untied embeddings) once with transformers'
``save_pretrained`` (500 MB shards plus ``model.safetensors.index.json``). Each measurement then
starts N fresh gloo processes (torchrun's variables) that each:
  * ``shards``:     hasten, the model built under ``init_empty_weights()`` on every process,
                    ``accelerator.prepare`` (FSDP2, ``cpu_ram_efficient_loading=True``), then
                    ``hasten.load_checkpoint_in_model(model, folder)``: every process reads its slices;
  * ``rank0``:      hasten's broadcast: process 0 ``from_pretrained`` (the whole model), the others on
                    ``meta``, ``prepare`` with ``cpu_ram_efficient_loading=True`` broadcasts the weights;
  * ``accelerate``: Accelerate's ``cpu_ram_efficient_loading`` (FSDP2): ``from_pretrained`` under
                    ``ACCELERATE_USE_FSDP`` (process 0 loads, the others get ``meta``), ``prepare``.
then run one training step (forward, backward, SGD step) on 16 tokens (``--no-step``: a forward). Reported per process:
the peak resident set size (``VmHWM``) once loaded and after the step, the RSS after imports
(the floor any process pays), and the seconds from the launch to the loaded model and to the end
of the first step. Rounds run the variants in rotating order; medians over rounds, the worst
process of each run; ratios are against ``shards``. The losses of the first step must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_attention_heads=16,
              num_key_value_heads=16, tie_word_embeddings=False)
VARIANTS = ("shards", "rank0", "accelerate")


def _make(folder: str, layers: int) -> dict:
    """Write the checkpoint (random weights) unless it is there; its size and largest tensor."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(folder, "config.json")):
        config = LlamaConfig(num_hidden_layers=layers, **CONFIG)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02, generator=generator)
        model.save_pretrained(folder, max_shard_size="500MB")
        del model
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    return {"bytes": total, "largest": CONFIG["vocab_size"] * CONFIG["hidden_size"] * 4}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _worker(variant: str, folder: str, out: str) -> None:
    launched = float(os.environ["BENCH_LAUNCHED"])
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    if variant == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin as Plugin

        import hasten  # noqa: F401 - imported by every variant, so that the floors compare
    else:
        from hasten import Accelerator, init_empty_weights, load_checkpoint_in_model
        from hasten.utils import FullyShardedDataParallelPlugin as Plugin

        import accelerate  # noqa: F401 - imported by every variant, so that the floors compare
    floor = _rss_kb("VmRSS")
    plugin = Plugin(fsdp_version=2, cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap",
                    transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(fsdp_plugin=plugin, cpu=True) if variant == "accelerate" else Accelerator(fsdp_plugin=plugin)
    rank = acc.process_index
    if variant == "accelerate":  # transformers sees ACCELERATE_USE_FSDP: only process 0 reads the files
        model = acc.prepare(LlamaForCausalLM.from_pretrained(folder))
    elif variant == "rank0" and rank == 0:
        model = acc.prepare(LlamaForCausalLM.from_pretrained(folder))
    else:
        with init_empty_weights():
            model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
        model = acc.prepare(model)
        if variant == "shards":
            load_checkpoint_in_model(model, folder)
    loaded = time.time()
    peak_loaded = _rss_kb("VmHWM")
    ids = torch.arange(16, device=acc.device).unsqueeze(0) * 7 % CONFIG["vocab_size"]
    if os.environ.get("BENCH_STEP", "1") == "1":
        opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=1e-3))
        loss = model(ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
    else:  # --no-step: a forward only (the check that every variant loaded the same weights)
        with torch.no_grad():
            loss = model(ids, labels=ids).loss
    stepped = time.time()
    result = {"rank": rank, "floor_mb": floor / 1024, "peak_loaded_mb": peak_loaded / 1024,
              "peak_step_mb": _rss_kb("VmHWM") / 1024, "to_loaded_s": loaded - launched,
              "to_step_s": stepped - launched, "loss": loss.item()}
    with open(os.path.join(out, f"{variant}-{rank}.json"), "w") as f:
        json.dump(result, f)
    acc.wait_for_everyone()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(variant: str, world: int, folder: str, out: str, timeout: float, step: bool = True) -> list[dict]:
    port = _free_port()
    launched = time.time()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", HASTEN_USE_CPU="1", ACCELERATE_USE_CPU="true",
                   BENCH_LAUNCHED=repr(launched), BENCH_STEP="1" if step else "0")
        if variant == "accelerate":
            env.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true", FSDP_VERSION="2")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", variant, folder, out], env=env))
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            break
    results = []
    for rank in range(world):
        path = os.path.join(out, f"{variant}-{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
            os.remove(path)
    if len(results) != world or any(p.returncode for p in procs):
        return []
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where the checkpoint is written (kept for reruns)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-step", dest="step", action="store_false",
                        help="a forward instead of a training step (the step's own peak and time left out)")
    args = parser.parse_args()
    folder = os.path.join(args.dir, f"llama-{args.layers}")
    facts = _make(folder, args.layers)
    out = os.path.join(args.dir, "results")
    os.makedirs(out, exist_ok=True)
    print(f"checkpoint {folder}: {facts['bytes'] / 2**20:.0f} MB, largest tensor {facts['largest'] / 2**20:.0f} MB")
    for world in args.worlds:
        runs: dict[str, list[list[dict]]] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            for variant in order:
                got = _launch(variant, world, folder, out, args.timeout, args.step)
                print(f"  world {world} round {r} {variant}: " + (json.dumps(got) if got else "FAILED"), flush=True)
                if got:
                    runs[variant].append(got)
        goal = facts["bytes"] / world / 2**20 + facts["largest"] / 2**20 + 300
        print(f"world {world}: goal for the loading peak above the floor <= {goal:.0f} MB "
              "(model / world + largest tensor + 300 MB)")
        base = None
        for variant in args.variants:
            if not runs[variant]:
                print(f"  {variant:10s} did not run")
                continue

            def med(key: str, worst=max) -> float:
                return statistics.median(worst(p[key] for p in run) for run in runs[variant])

            above = statistics.median(max(p["peak_loaded_mb"] - p["floor_mb"] for p in run) for run in runs[variant])
            row = {"peak_loaded_mb": med("peak_loaded_mb"), "above_floor_mb": above, "peak_step_mb": med("peak_step_mb"),
                   "to_loaded_s": med("to_loaded_s"), "to_step_s": med("to_step_s")}
            losses = sorted({round(p["loss"], 5) for run in runs[variant] for p in run})
            base = base or row
            ratios = " ".join(f"{k}x{row[k] / base[k]:.2f}" for k in ("peak_loaded_mb", "to_step_s"))
            print(f"  {variant:10s} peak loaded {row['peak_loaded_mb']:7.0f} MB (above floor {above:6.0f}), "
                  f"peak after step {row['peak_step_mb']:7.0f} MB, loaded at {row['to_loaded_s']:6.1f} s, "
                  f"first step at {row['to_step_s']:6.1f} s | vs shards: {ratios} | loss {losses}")


if __name__ == "__main__":
    main()
