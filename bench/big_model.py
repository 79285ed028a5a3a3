"""Peak host memory while loading and dispatching a sharded checkpoint: hasten vs Accelerate.

    python bench/big_model.py                  # ~430 MB Llama-shaped model, 5 shards, 3 interleaved rounds
    python bench/big_model.py --layers 8 --shard 100MB --rounds 5

The parent process builds a float32 Llama-shaped model (tied embeddings) from a config, saves it
once with ``hasten.save_model`` in shards of ``--shard`` and prints the shard size. Each measurement
then runs in a fresh Python process: import the library, build the model under
``init_empty_weights()`` (shapes only), record the resident set size (RSS), and call
``load_checkpoint_and_dispatch`` then one forward of 3 tokens. A thread samples RSS every
millisecond; reported (above the starting RSS): the peak over the call and the forward, the peak
during the call alone, and the RSS after the forward. Both libraries read safetensors through
memory maps, so weights kept in RAM may count in RSS only once a forward touches them: the RSS
after the forward is what the dispatched model holds, and ``peak - after`` is the transient cost
of loading and running it (the goal: about one shard at most).
Scenarios:
  * ``ram``:  ``device_map={"": "cpu"}``: the whole model ends in RAM;
  * ``disk``: ``device_map="auto"`` with ``max_memory={"cpu": 60% of the model}``: the rest is
    offloaded to a folder on disk (hasten: safetensors files; Accelerate: raw ``.dat`` arrays).
Rounds run the variants in rotating order (hasten and Accelerate interleaved); medians are shown
with the hasten / Accelerate ratio of the peak. The worker also runs one forward to check that the
dispatched model works. Disk writes go to ``--dir`` (default: a temp folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
              num_key_value_heads=16, tie_word_embeddings=True)


def _save(folder: str, layers: int, shard: str) -> tuple[int, int]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hasten.saving import save_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **CONFIG))
    save_model(model.state_dict(), folder, max_shard_size=shard)
    sizes = [os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")]
    return max(sizes), sum(sizes)


WORKER = r'''
import json, os, sys, threading, time
import psutil, torch
library, scenario, checkpoint, offload, layers, total = sys.argv[1:7]
layers, total = int(layers), int(total)
if library == "hasten":
    from hasten import init_empty_weights, load_checkpoint_and_dispatch
else:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from transformers import LlamaConfig, LlamaForCausalLM
import logging; logging.disable(logging.WARNING)
config = LlamaConfig(num_hidden_layers=layers, **json.loads(os.environ["BENCH_CONFIG"]))
with init_empty_weights():
    model = LlamaForCausalLM(config)
model.tie_weights()
model.eval()
process = psutil.Process()
start = process.memory_info().rss
peak = [start]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.001)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
if scenario == "ram":
    kwargs = dict(device_map={"": "cpu"})
else:
    kwargs = dict(device_map="auto", max_memory={"cpu": int(total * 0.6)}, offload_folder=offload,
                  no_split_module_classes=["LlamaDecoderLayer"])
began = time.perf_counter()
model = load_checkpoint_and_dispatch(model, checkpoint, **kwargs)
seconds = time.perf_counter() - began
peak_dispatch = max(peak[0], process.memory_info().rss)
disk = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()})
with torch.no_grad():
    out = model(torch.tensor([[1, 2, 3]])).logits
assert torch.isfinite(out).all()
done.set(); thread.join()
used = process.memory_info().rss - start
peak_all = max(peak[0], process.memory_info().rss)
print(json.dumps({"dispatch": peak_dispatch - start, "peak": peak_all - start, "used": used, "seconds": seconds,
                  "devices": disk}))
'''


def _run(library: str, scenario: str, checkpoint: str, offload: str, layers: int, total: int) -> dict:
    shutil.rmtree(offload, ignore_errors=True)
    env = dict(os.environ, BENCH_CONFIG=json.dumps(CONFIG))
    done = subprocess.run([sys.executable, "-c", WORKER, library, scenario, checkpoint, offload, str(layers),
                           str(total)], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{library}/{scenario} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--shard", default="100MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench-big-model-")
    try:
        checkpoint = os.path.join(root, "ckpt")
        shard, total = _save(checkpoint, args.layers, args.shard)
        count = len([f for f in os.listdir(checkpoint) if f.endswith(".safetensors")])
        mb = 1e6
        print(f"model {total / mb:.0f} MB in {count} shards, largest shard {shard / mb:.0f} MB")
        variants = [(lib, sc) for sc in ("ram", "disk") for lib in ("hasten", "accelerate")]
        results: dict = {v: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for lib, sc in order:
                results[(lib, sc)].append(_run(lib, sc, checkpoint, os.path.join(root, "offload"), args.layers, total))
        for sc in ("ram", "disk"):
            row = {}
            for lib in ("hasten", "accelerate"):
                runs = results[(lib, sc)]
                row[lib] = {k: statistics.median(x[k] for x in runs) for k in ("dispatch", "peak", "used", "seconds")}
                m = row[lib]
                print(f"{sc:5s} {lib:10s} peak +{m['peak'] / mb:5.0f} MB (during the dispatch call +{m['dispatch'] / mb:4.0f}),"
                      f" after a forward +{m['used'] / mb:5.0f} MB, peak - after = {(m['peak'] - m['used']) / mb:4.0f} MB"
                      f" = {(m['peak'] - m['used']) / shard:4.2f} shards; dispatch {m['seconds']:5.2f} s;"
                      f" devices {runs[0]['devices']}")
            print(f"{sc:5s} peak ratio hasten / accelerate: {row['hasten']['peak'] / row['accelerate']['peak']:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
