"""``hasten estimate-memory`` against the memory a real training step allocates.

    python bench/estimate_memory.py                   # ~11M-parameter Llama from a config, 2 processes
    python bench/estimate_memory.py --layers 8 --hidden 512

A small transformers model is built from a config (no download) and trained one step with Adam on
CPU: in one process, with DDP over 2 gloo processes and with FSDP2 (``fully_shard`` per decoder
layer, then the root) over 2 gloo processes, in fp32 and with bf16 ``MixedPrecisionPolicy``. After
the step each process sums the bytes of the storages behind its parameters, buffers, gradients,
DDP's communication buckets and the optimizer state (each storage once: FSDP2's padded shards and
DDP's buckets count as allocated). The estimate is the ``estimate-memory`` row of the same
strategy and dtype (rank 0's FSDP2 shard is the largest), without the gathered layer, which is
freed again by the time the step ends. Prints one line per case with the ratio estimate/measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config)


def storages(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard's storage)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def step_and_measure(model, opt, vocab, ddp=None, buckets=None) -> dict:
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    (ddp or model)(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = storages(list(model.parameters()) + list(model.buffers()))
    grads = storages(p.grad for p in model.parameters()) + sum((buckets or {}).values())
    states = storages(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"parameters": params, "gradients": grads, "optimizer": states, "total": params + grads + states}


def bucket_recorder(world: int, sink: dict):
    """A DDP comm hook that averages as DDP does and records each flat bucket's storage size."""

    def hook(state, bucket):
        buffer = bucket.buffer()
        sink[bucket.index()] = buffer.untyped_storage().nbytes()
        work = dist.all_reduce(buffer.div_(world), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    results = {}
    for case in ("DDP float32", "FSDP2 float32", "FSDP2 bfloat16"):
        _, model = build(args)
        ddp, buckets = None, {}
        if case.startswith("DDP"):
            ddp = DistributedDataParallel(model)
            ddp.register_comm_hook(None, bucket_recorder(world, buckets))
        else:
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if case.endswith("bfloat16") else MixedPrecisionPolicy()
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp_policy)
            fully_shard(model, mp_policy=mp_policy)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        results[case] = step_and_measure(model, opt, args.vocab, ddp, buckets)
        del model, opt, ddp
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32001)  # odd: FSDP2 pads the embedding's rows
    args = parser.parse_args()

    from hasten.commands.estimate import measure
    from hasten.commands.memory_model import estimate

    _, model = build(args)
    with torch.device("meta"):
        sizes = measure(build(args)[1], "bench")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    measured = {"single float32": step_and_measure(model, opt, args.vocab)}
    del model, opt

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="hasten-bench-"), "rank0.json")
    mp.spawn(worker, args=(2, port, args, out), nprocs=2, join=True)
    with open(out) as f:
        measured.update(json.load(f))

    print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
          f"{sizes.num_parameters / 1e6:.2f}M parameters; per process, after one Adam step, rank 0")
    print(f"{'case':<16} {'estimate (B)':>14} {'measured (B)':>14} {'ratio':>8}   MiB estimate~measured: "
          "parameters / gradients / optimizer")
    for case, real in measured.items():
        strategy, dtype = case.split()
        guess = estimate(sizes, dtype, 1 if strategy == "single" else 2)[strategy]
        guess_total = guess["total"] - guess["gathered_layer"]
        parts = " / ".join(f"{guess[k] / 2**20:.2f}~{real[k] / 2**20:.2f}" for k in ("parameters", "gradients", "optimizer"))
        print(f"{case:<16} {guess_total:>14,} {real['total']:>14,} {guess_total / real['total']:>8.5f}   {parts}")


if __name__ == "__main__":
    main()
