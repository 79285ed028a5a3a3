"""Several models in one job: a trained model beside a frozen one, on 2 CPU processes (gloo), under DDP
and FSDP2: hasten against hand-written PyTorch and against Accelerate, interleaved in one run.

    python bench/several_models.py                       # both jobs, DDP and FSDP2, 1 round
    python bench/several_models.py --jobs dpo --strategies fsdp2 --rounds 3 --steps 12
    python bench/several_models.py --quick               # tiny models, 1 round: a smoke test

Jobs: ``dpo``, a policy (AdamW) beside a frozen reference of the same shape (DPO loss on chosen /
rejected sequences); ``distill``, a student (AdamW) beside a wider frozen teacher (KL of their token
distributions). The models are a next-token MLP language model (embedding, residual ``Block``s,
head) built from one seed, so the three ways start from the same weights and the first loss must
agree. Ways:

- ``raw``: hand-written ``DistributedDataParallel`` around the trained model and the frozen one
  in eval mode beside it (DDP); ``fully_shard`` on every block and the root of both models (FSDP2).
- ``hasten``: ``accelerator.prepare(trained, optimizer, frozen)`` in one call.
- ``accelerate``: the same call; where Accelerate refuses it, what it says is recorded and the
  job goes on the way its users work around it: the trained model and optimizer prepared alone,
  the frozen model moved to the device whole. Accelerate 1.15 ignores the FSDP plugin on CPU
  processes (its ``MULTI_CPU`` type is not among those FSDP applies to), so its FSDP2 rows run DDP,
  which the table's notes say; on GPUs its ``prepare`` refuses a second model under FSDP2 ("Only one
  model is supported when using FSDP2") and a model without an optimizer.

Every (strategy, job, way) is one fresh 2-process launch; the three ways of a (strategy, job) run
one after the other, the first of them rotating from group to group (``--rounds 2`` repeats the
whole; each launch takes ~10 s on an idle 2-core machine, so the default run is ~2-3 minutes). Reported per process (worst of the 2): the median step time over ``--steps``
timed steps (after 2 warm-up steps), the peak RSS, and the peak RSS above the floor after importing
torch, hasten and Accelerate (every way imports all three, so the floors compare); ratios to raw.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _procs  # noqa: E402

WAYS = ("raw", "hasten", "accelerate")
SIZES = {  # name: (vocab, hidden, blocks, teacher hidden, batch per process, sequence)
    "default": (4096, 384, 4, 512, 2, 32),
    "quick": (64, 16, 2, 24, 2, 8),
}


def _model_class() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(nn.functional.gelu(self.up(h)))

    class LM(nn.Module):
        def __init__(self, vocab: int, hidden: int, blocks: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
            self.head = nn.Linear(hidden, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    return LM


def _models(job: str, size: str) -> tuple[Any, Any]:
    import torch

    vocab, hidden, blocks, teacher, _, _ = SIZES[size]
    LM = _model_class()
    torch.manual_seed(1)
    trained = LM(vocab, hidden, blocks)
    torch.manual_seed(2 if job == "distill" else 1)
    other = LM(vocab, teacher if job == "distill" else hidden, blocks)
    return trained, other.eval().requires_grad_(False)


def _loss(job: str, trained: Any, other: Any, batch: tuple) -> Any:
    import torch
    from torch.nn import functional as F

    if job == "distill":
        (ids,) = batch
        with torch.no_grad():
            target = F.softmax(other(ids).float() / 2.0, dim=-1)
        logp = F.log_softmax(trained(ids).float() / 2.0, dim=-1)
        return F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), reduction="batchmean")

    def logp(model: Any, ids: torch.Tensor) -> torch.Tensor:
        return torch.gather(F.log_softmax(model(ids[:, :-1]).float(), -1), 2, ids[:, 1:, None]).squeeze(2).sum(1)

    chosen, rejected = batch
    with torch.no_grad():
        ref_c, ref_r = logp(other, chosen), logp(other, rejected)
    margin = (logp(trained, chosen) - ref_c) - (logp(trained, rejected) - ref_r)
    return -F.logsigmoid(0.1 * margin).mean()


def _raw(strategy: str, trained: Any, other: Any) -> tuple[Any, Any, Any, Any, list]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if strategy == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(trained)
    else:
        from torch.distributed.fsdp import fully_shard

        for model in (trained, other):
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-4)
    return trained, opt, other, (lambda loss: loss.backward()), []


def _framework(way: str, strategy: str, trained: Any, other: Any) -> tuple[Any, Any, Any, Any, list]:
    """hasten or Accelerate: one prepare call; Accelerate's refusals recorded, then its users' workaround."""
    import torch

    if way == "hasten":
        from hasten import Accelerator
        from hasten.utils import FullyShardedDataParallelPlugin as Plugin
    else:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin as Plugin
    plugin = None
    if way == "accelerate" and strategy == "fsdp2":  # what `accelerate launch --use_fsdp --fsdp_version 2` sets
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    if strategy == "fsdp2":
        plugin = Plugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-4)
    notes = []
    try:
        trained, opt, other = acc.prepare(trained, opt, other)
    except Exception as e:  # noqa: BLE001 - what Accelerate says is the figure here
        notes.append(f"prepare(trained, opt, frozen): {type(e).__name__}: {e}")
        trained, opt = acc.prepare(trained, opt)
        try:
            other = acc.prepare(other)
        except Exception as e2:  # noqa: BLE001
            notes.append(f"prepare(frozen): {type(e2).__name__}: {e2}")
            other = other.to(acc.device)
            notes.append("workaround: frozen model whole on every process, not prepared")
    kind = str(acc.distributed_type).split(".")[-1]
    if strategy == "fsdp2" and kind != "FSDP":  # Accelerate applies the plugin on GPUs (and the like) only
        notes.insert(0, f"the FSDP plugin was ignored: distributed_type is {kind}, so this row ran DDP")
    if not notes and strategy == "fsdp2" and not _is_sharded(other):
        notes.append("frozen model prepared but not sharded")
    return trained, opt, other, acc.backward, notes


def _is_sharded(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def worker(out: str, way: str, strategy: str, job: str, size: str, steps: int) -> None:
    import torch

    import accelerate  # noqa: F401 - every way imports all three, so that the floors compare
    import hasten  # noqa: F401

    torch.set_num_threads(1)
    floor = _procs.rss_mb()
    peak_resets = _procs.reset_peak_rss()
    trained, other = _models(job, size)
    if way == "raw":
        trained, opt, other, backward, notes = _raw(strategy, trained, other)
    else:
        trained, opt, other, backward, notes = _framework(way, strategy, trained, other)
    rank = int(os.environ["RANK"])
    vocab, _, _, _, batch, seq = SIZES[size]
    g = torch.Generator().manual_seed(100 + rank)
    batches = [tuple(torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(1 if job == "distill" else 2))
               for _ in range(steps + 2)]
    times, losses = [], []
    for i, data in enumerate(batches):
        start = time.perf_counter()
        loss = _loss(job, trained, other, data)
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i >= 2:
            times.append(time.perf_counter() - start)
    _procs.write_result(out, {"step_s": statistics.median(times), "peak_mb": _procs.peak_rss_mb(), "floor_mb": floor,
                              "peak_resets": peak_resets, "first_loss": losses[0], "last_loss": losses[-1],
                              "frozen_sharded": _is_sharded(other), "notes": notes})


def run_all(args: argparse.Namespace) -> dict:
    """(strategy, job) -> way -> per-round results (worst process), the ways interleaved."""
    results: dict = {}
    turn = 0
    for _ in range(args.rounds):
        for strategy in args.strategies:
            for job in args.jobs:
                ways = WAYS[turn % 3:] + WAYS[:turn % 3]  # who goes first turns with every group
                turn += 1
                for way in ways:
                    ranks = _procs.spawn(os.path.abspath(__file__), ["--way", way, "--strategy", strategy, "--job", job,
                                                                       "--size", args.size, "--steps", str(args.steps)], 2)
                    worst = {"step_s": max(x["step_s"] for x in ranks), "peak_mb": max(x["peak_mb"] for x in ranks),
                             "added_mb": max(x["peak_mb"] - x["floor_mb"] for x in ranks),
                             "first_loss": ranks[0]["first_loss"], "frozen_sharded": ranks[0]["frozen_sharded"],
                             "notes": ranks[0]["notes"]}
                    results.setdefault((strategy, job), {}).setdefault(way, []).append(worst)
    return results


def print_table(results: dict) -> list[str]:
    print("| strategy | job | way | step s (median) | step vs raw | peak RSS MB | vs raw | added MB | vs raw | frozen sharded |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for (strategy, job), by_way in results.items():
        def med(way: str, key: str) -> float:
            return statistics.median(x[key] for x in by_way[way])

        first = {way: by_way[way][0]["first_loss"] for way in by_way}
        for way in WAYS:
            step, peak, added = med(way, "step_s"), med(way, "peak_mb"), med(way, "added_mb")
            print(f"| {strategy} | {job} | {way} | {step:.4f} | {step / med('raw', 'step_s'):.2f} | {peak:.0f} | "
                  f"{peak / med('raw', 'peak_mb'):.2f} | {added:.0f} | {added / med('raw', 'added_mb'):.2f} | "
                  f"{'yes' if by_way[way][0]['frozen_sharded'] else 'no'} |")
            for note in by_way[way][0]["notes"]:
                notes.append(f"{strategy}/{job}/{way}: {note.splitlines()[0][:220]}")
        if max(first.values()) - min(first.values()) > 1e-4 * max(1.0, abs(first["raw"])):
            notes.append(f"{strategy}/{job}: FIRST LOSSES DIFFER {first}")
    for note in notes:
        print("note: " + note)
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", choices=["ddp", "fsdp2"], default=["ddp", "fsdp2"])
    parser.add_argument("--jobs", nargs="+", choices=["dpo", "distill"], default=["dpo", "distill"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per launch (after 2 warm-up steps)")
    parser.add_argument("--size", choices=list(SIZES), default="default")
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 round of 2 steps (a smoke test)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.way, args.strategy, args.job, args.size, args.steps)
        _procs.end_worker()
        return
    if args.quick:
        args.size, args.rounds, args.steps = "quick", 1, 2
    _procs.header()
    vocab, hidden, blocks, teacher, batch, seq = SIZES[args.size]
    print(f"2 processes (gloo); LM vocab {vocab}, hidden {hidden}, {blocks} blocks (teacher hidden {teacher}); "
          f"batch {batch} x {seq} per process; AdamW; {args.rounds} rounds x {args.steps} timed steps")
    results = run_all(args)
    print_table(results)
    _procs.footer()


if __name__ == "__main__":
    main()
