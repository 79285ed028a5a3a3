"""Load a pretrained transformers checkpoint straight into FSDP2 shards, then fine-tune.

No process ever holds the whole model: every process builds it on ``meta``, ``prepare`` shards it,
and ``load_checkpoint_in_model`` reads each process's own slices of the safetensors files.

    hasten launch --cpu --num_processes 2 examples/load_into_shards.py --tiny
    hasten launch --num_processes 8 examples/load_into_shards.py --model path/to/llama

``--tiny`` first writes a small Llama with ``save_pretrained`` (a stand-in for a downloaded folder)
and checks that the sharded model computes exactly what the plain one does.
"""

import argparse
import os
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from hasten import Accelerator, FullyShardedDataParallelPlugin, init_empty_weights, load_checkpoint_in_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local transformers folder (model.safetensors or an index)")
    parser.add_argument("--tiny", action="store_true", help="write and use a tiny Llama instead")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    accelerator = Accelerator(fsdp_plugin=plugin)
    folder = args.model
    if args.tiny:
        folder = os.path.join(tempfile.gettempdir(), f"hasten-tiny-llama-{os.getuid()}")
        if accelerator.is_main_process:
            config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="100KB")
        accelerator.wait_for_everyone()
    if not folder:
        parser.error("pass --model FOLDER or --tiny")

    with init_empty_weights():  # on every process: parameters on meta, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    load_checkpoint_in_model(model, folder)  # each process reads only the slices it owns

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
    ids = ids.to(accelerator.device)
    if args.tiny:  # the sharded model computes what the plain model loaded from the folder computes
        with torch.no_grad():
            sharded = model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(folder).to(accelerator.device).eval()
        with torch.no_grad():
            assert torch.equal(sharded, plain(ids).logits), "sharded and plain outputs differ"
        accelerator.print("loaded into shards: outputs equal the plain model's")

    model.train()
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {loss.item():.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
