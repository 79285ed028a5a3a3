"""Expert parallelism and long sequences: tokens/s and peak memory, on 2 CPU processes (gloo).

    python bench/moe_and_sequences.py                        # both parts, 3 rounds (~10 minutes idle)
    python bench/moe_and_sequences.py --part moe --rounds 5 --steps 8
    python bench/moe_and_sequences.py --part seq --seq 8192
    python bench/moe_and_sequences.py --quick                # tiny sizes, 1 round: a smoke test (seconds)

**MoE part.** One Qwen3-MoE (``--experts`` experts per layer, top-2, ``--moe-layers`` layers; the
experts hold most of the weights), built from one seed, trained with AdamW on the same data (each
process its own ``--moe-batch`` x ``--moe-seq`` tokens a step), three ways, all through hasten:

* ``ddp``: no parallelism config, DDP: every process holds every expert (replicated weights,
  gradients and AdamW state).
* ``fsdp2``: ``FullyShardedDataParallelPlugin(fsdp_version=2)``, no ep: every parameter (experts
  included) sharded over the 2 processes, gathered layer by layer for compute; each process still
  computes every expert its own tokens chose.
* ``ep2``: the same plugin and ``ParallelismConfig(ep_size=2)``: each process holds 4 of the 8 whole
  experts; every (token, expert) pair travels to the expert's process and back (two all-to-alls per
  layer, forward and backward); everything else FSDP2-sharded.

**Long-sequence part.** A tiny-width Llama (``--seq-hidden``, 2 layers, sdpa) trained on batches of
one sequence of ``--seq`` tokens (AdamW), three ways:

* ``one``: one process, the whole sequence. This is the baseline the split is for: a sequence too
  long for one device's activation memory. DDP is not that baseline: on the same global batch (one
  sequence) it has nothing to split, and on two sequences each DDP process holds one whole sequence,
  i.e. the ``one`` row's memory.
* ``sp2``: ``ParallelismConfig(sp_size=2)`` (Ulysses, with DDP): each process keeps half of the
  sequence; attention runs on the whole sequence for half of the heads (all-to-all in and out).
* ``cp2``: ``ParallelismConfig(cp_size=2)`` with FSDP2 (cp requires it): ring attention, each process
  keeps its two quarter-chunks of the sequence (load balancing), keys and values travel.

The split runs use ``accelerator.maybe_context_parallel`` and ``accelerator.loss_over_sequence`` as
docs/sharded.md shows. The ``one`` row runs on one core, the split rows on two (one thread per
process), so the tokens/s of a split row against ``one`` is what a second process buys for one
sequence, not a speed-up at equal hardware; the CPU time per process is printed beside it.

Every configuration is one fresh launch (``--warmup`` untimed steps, then ``--steps`` timed ones:
forward, backward, ``optimizer.step``, ``zero_grad``); launches rotate within a round and rounds
repeat (``--rounds``). Reported per configuration: the median over rounds of the slowest process's
median step time, tokens/s of the whole job (global tokens a step / that time) and its ratio to the
baseline (``ddp``, ``one``); per process (worst of the ranks, median over rounds): peak RSS over the
whole process (``VmHWM``; about 400 MB of it is Python, torch, transformers and the process group),
the peak above the *floor* (the RSS after ``Accelerator()``, before the model is built: everything
the model and its training add) and above the RSS once ``prepare`` returned (what the steps add:
optimizer state, gradients, activations kept for backward, communication buffers; a peak reached in
the warm-up steps counts, since the allocator keeps what it freed); and the weights + AdamW state
this process holds (its local shards), computed from the parameters. The timed steps' own peak
above the RSS before them is in the JSON (``steps_add_mb``; small when the warm-up already reached
the peak).

CPU figures (gloo, a small VM): communication is cheap next to CPU compute here and the kernels are
not GPU kernels; memory ratios carry over better than speed ratios. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _procs  # noqa: E402

MOE_CONFIGS = ("ddp", "fsdp2", "ep2")
SEQ_CONFIGS = ("one", "sp2", "cp2")
PROCESSES = {"ddp": 2, "fsdp2": 2, "ep2": 2, "one": 1, "sp2": 2, "cp2": 2}
QUICK = dict(experts=4, moe_hidden=32, moe_inter=16, moe_layers=2, moe_batch=2, moe_seq=16, vocab=128,
             seq=64, seq_hidden=32, steps=2, warmup=1, rounds=1)


def moe_model(args):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.moe_hidden, intermediate_size=2 * args.moe_hidden,
                         moe_intermediate_size=args.moe_inter, num_hidden_layers=args.moe_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=args.moe_hidden // 4,
                         num_experts=args.experts, num_experts_per_tok=2, output_router_logits=True,
                         router_aux_loss_coef=0.01, max_position_embeddings=max(64, args.moe_seq))
    return Qwen3MoeForCausalLM(cfg)


def seq_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.seq_hidden, intermediate_size=4 * args.seq_hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.seq, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _accelerator(config: str):
    from hasten import Accelerator
    from hasten.utils import ParallelismConfig
    from hasten.utils.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin

    if config in ("ddp", "one"):
        return Accelerator()
    if config == "fsdp2":
        return Accelerator(fsdp_plugin=Plugin(fsdp_version=2))
    if config == "ep2":
        return Accelerator(parallelism_config=ParallelismConfig(ep_size=2), fsdp_plugin=Plugin(fsdp_version=2))
    if config == "sp2":
        return Accelerator(parallelism_config=ParallelismConfig(sp_size=2))
    if config == "cp2":
        return Accelerator(parallelism_config=ParallelismConfig(cp_size=2), fsdp_plugin=Plugin(fsdp_version=2))
    raise ValueError(f"unknown configuration {config!r}")


def _held_mb(model, optimizer) -> float:
    """This process's weights, any gradients and optimizer state (local shards), MB."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += local(v).numel() * v.element_size()
    return total / 1e6


def worker(out: str, args: argparse.Namespace) -> None:
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    config = args.config
    acc = _accelerator(config)
    rss_floor = _procs.rss_mb()
    moe = config in MOE_CONFIGS
    model = moe_model(args) if moe else seq_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    rss_prepared = _procs.rss_mb()
    rank, world = acc.process_index, acc.num_processes
    gen = torch.Generator().manual_seed(1)
    if moe:  # each process its own batch
        batches = [torch.randint(0, args.vocab, (args.moe_batch * world, args.moe_seq), generator=gen)
                   for _ in range(args.warmup + args.steps)]
        global_tokens = args.moe_batch * args.moe_seq * world

        def step(i: int) -> float:
            mine = batches[i][rank * args.moe_batch:(rank + 1) * args.moe_batch].to(acc.device)
            loss = model(input_ids=mine, labels=mine).loss
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return float(loss)
    else:  # one sequence a step, the same on every process (cp/sp are not data axes)
        batches = [torch.randint(0, args.vocab, (1, args.seq), generator=gen) for _ in range(args.warmup + args.steps)]
        global_tokens = args.seq

        def step(i: int) -> float:
            ids = batches[i].clone().to(acc.device)
            labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # shifted before any split
            pos = torch.arange(args.seq, device=ids.device).unsqueeze(0)
            buffers = [ids, labels, pos]
            with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                            no_restore_buffers=set(buffers)):
                out_ = model(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels)
                loss = acc.loss_over_sequence(out_.loss, (labels != -100).sum())
                acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return float(loss)

    losses = [step(i) for i in range(args.warmup)]
    held = _held_mb(model, optimizer)  # optimizer state exists now; gradients were just zeroed (None)
    if dist.is_initialized():
        dist.barrier()
    rss_before = _procs.rss_mb()
    reset = _procs.reset_peak_rss()
    times, cpu = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(step(i))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    result = {"config": config, "rank": rank, "world": world, "step_s": statistics.median(times),
              "cpu_s": statistics.median(cpu), "global_tokens": global_tokens, "first_loss": losses[0],
              "rss_floor_mb": rss_floor, "rss_prepared_mb": rss_prepared, "rss_before_steps_mb": rss_before,
              "peak_steps_mb": _procs.peak_rss_mb() if reset else None,
              "peak_process_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "held_mb": held}
    _procs.write_result(out, result)
    if dist.is_initialized():
        dist.barrier()


def summarize(runs: dict[str, list[list[dict]]], base: str) -> list[dict]:
    def step_of(run):
        return max(rk["step_s"] for rk in run)

    base_step = statistics.median(step_of(run) for run in runs[base])
    rows = []
    for config, launches in runs.items():
        step = statistics.median(step_of(run) for run in launches)
        tokens = launches[0][0]["global_tokens"]
        adds = [rk["peak_steps_mb"] - rk["rss_before_steps_mb"] for run in launches for rk in run
                if rk["peak_steps_mb"] is not None]
        rows.append({"config": config, "processes": len(launches[0]), "step_s": step, "tokens_per_s": tokens / step,
                     "tokens_vs_base": (tokens / step) / (launches[0][0]["global_tokens"] / base_step)
                     if base == config else (tokens / step) / (runs[base][0][0]["global_tokens"] / base_step),
                     "cpu_s": max(statistics.median(run[k]["cpu_s"] for run in launches)
                                  for k in range(len(launches[0]))),
                     "peak_process_mb": max(rk["peak_process_mb"] for run in launches for rk in run),
                     "above_floor_mb": max(statistics.median(run[k]["peak_process_mb"] - run[k]["rss_floor_mb"]
                                                             for run in launches) for k in range(len(launches[0]))),
                     "above_prepared_mb": max(statistics.median(run[k]["peak_process_mb"] - run[k]["rss_prepared_mb"]
                                                                for run in launches) for k in range(len(launches[0]))),
                     "steps_add_mb": statistics.median(adds) if adds else None,
                     "steps_add_max_mb": max(adds) if adds else None,
                     "held_mb": max(rk["held_mb"] for run in launches for rk in run),
                     "first_loss": launches[0][0]["first_loss"]})
    for row in rows:
        ref = next(r for r in rows if r["config"] == base)
        row["peak_vs_base"] = row["peak_process_mb"] / ref["peak_process_mb"]
        row["held_vs_base"] = row["held_mb"] / ref["held_mb"]
        row["floor_vs_base"] = row["above_floor_mb"] / ref["above_floor_mb"]
        row["prepared_vs_base"] = row["above_prepared_mb"] / ref["above_prepared_mb"]
        row["add_vs_base"] = (row["steps_add_mb"] / ref["steps_add_mb"]
                              if row["steps_add_mb"] is not None and ref["steps_add_mb"] else None)
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print("| config | processes | step s (median) | tokens/s | vs base | CPU s / step (worst rank) | peak RSS MB | "
          "vs base | above floor MB | vs base | above prepared MB | vs base | weights+AdamW MB | vs base | "
          "first loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['processes']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_vs_base']:.2f} | {r['cpu_s']:.3f} | {r['peak_process_mb']:.0f} | {r['peak_vs_base']:.2f} | "
              f"{r['above_floor_mb']:.0f} | {r['floor_vs_base']:.2f} | {r['above_prepared_mb']:.0f} | "
              f"{r['prepared_vs_base']:.2f} | {r['held_mb']:.1f} | {r['held_vs_base']:.2f} | {r['first_loss']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("moe", "seq", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round: a smoke test")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--moe-hidden", type=int, default=256)
    parser.add_argument("--moe-inter", type=int, default=512, help="each expert's intermediate size")
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--moe-batch", type=int, default=4, help="sequences per process per step")
    parser.add_argument("--moe-seq", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096, help="tokens of the one long sequence of each step")
    parser.add_argument("--seq-hidden", type=int, default=128)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.worker:
        worker(args.worker, args)
        _procs.end_worker()
        return
    _procs.header()
    passed = ["--steps", "--warmup", "--vocab", "--experts", "--moe-hidden", "--moe-inter", "--moe-layers",
              "--moe-batch", "--moe-seq", "--seq", "--seq-hidden"]
    shared = [x for flag in passed for x in (flag, str(getattr(args, flag[2:].replace("-", "_"))))]
    configs = (list(MOE_CONFIGS) if args.part in ("moe", "both") else []) + \
              (list(SEQ_CONFIGS) if args.part in ("seq", "both") else [])
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    runs: dict[str, list[list[dict]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            runs[config].append(_procs.spawn(os.path.abspath(__file__), ["--config", config, *shared],
                                             PROCESSES[config], extra_path=src))
        print(f"round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", flush=True)
    payload = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "config")}}
    if args.part in ("moe", "both"):
        rows = summarize({c: runs[c] for c in MOE_CONFIGS}, "ddp")
        print_table(f"MoE: Qwen3-MoE, {args.moe_layers} layers, {args.experts} experts (top-2, each "
                    f"{args.moe_hidden}->{args.moe_inter}), {args.moe_batch} x {args.moe_seq} tokens per process; "
                    f"median of {args.rounds} rounds x {args.steps} steps; base: ddp", rows)
        payload["moe"] = rows
    if args.part in ("seq", "both"):
        rows = summarize({c: runs[c] for c in SEQ_CONFIGS}, "one")
        print_table(f"Long sequence: Llama, 2 layers, hidden {args.seq_hidden}, one sequence of {args.seq} tokens a "
                    f"step; median of {args.rounds} rounds x {args.steps} steps; base: one process", rows)
        payload["seq"] = rows
    _procs.emit(payload, args.json)
    _procs.footer()


if __name__ == "__main__":
    main()
