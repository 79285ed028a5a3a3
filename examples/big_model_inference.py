"""Generate with a causal LM larger than one device: build it empty, load it layer by layer over GPUs, CPU and disk.

    python examples/big_model_inference.py --model_name_or_path ./my-llama --device_map auto
    python examples/big_model_inference.py --tiny                          # a tiny Llama saved here first
    python examples/big_model_inference.py --tiny --device_map cpu_disk    # half the layers read from disk

`--check` (on with `--tiny`) also loads the model the ordinary way and prints `ok` when both give
the same tokens. No training process, no launcher: run it with plain `python`.
"""

import argparse
import os
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from hasten import init_empty_weights, load_checkpoint_and_dispatch


def save_tiny_llama(folder: str) -> None:
    """A 4-layer Llama with tied embeddings, saved as transformers saves any model."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.5)  # large enough weights that greedy decoding varies
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="40KB")  # several shards


def cpu_and_disk_map(config) -> dict:
    """The first half of the decoder layers in RAM, the second half on disk (read back at each forward)."""
    half = config.num_hidden_layers // 2
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for i in range(config.num_hidden_layers):
        device_map[f"model.layers.{i}"] = "cpu" if i < half else "disk"
    return device_map


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", help="a local folder with config.json and *.safetensors")
    parser.add_argument("--tiny", action="store_true", help="save a tiny Llama to a temporary folder and use it")
    parser.add_argument("--device_map", default="auto", help='"auto", "balanced", "sequential" or "cpu_disk"')
    parser.add_argument("--offload_folder", default=None, help="where disk-offloaded weights go (default: temporary)")
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--check", action="store_true", help="compare with the model loaded the ordinary way")
    args = parser.parse_args()
    if not args.tiny and not args.model_name_or_path:
        parser.error("give --model_name_or_path or --tiny")

    with tempfile.TemporaryDirectory() as scratch:
        path = args.model_name_or_path
        if args.tiny:
            path = os.path.join(scratch, "tiny-llama")
            save_tiny_llama(path)
        config = AutoConfig.from_pretrained(path)

        # 1. The model's structure without memory: every parameter on the "meta" device.
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()  # embeddings and LM head share one tensor, as in the saved model

        # 2. Weights read shard by shard straight to where the device map puts them.
        device_map = cpu_and_disk_map(config) if args.device_map == "cpu_disk" else args.device_map
        model = load_checkpoint_and_dispatch(
            model, path, device_map=device_map,
            no_split_module_classes=model._no_split_modules,  # never split a decoder layer across devices
            offload_folder=args.offload_folder or os.path.join(scratch, "offload"))
        model.eval()
        print("device map:", model.hf_device_map)

        # 3. Generation as usual; each layer's weights come to the compute device when it runs.
        prompt = torch.arange(1, 7).unsqueeze(0)  # token ids; in real use: tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            logits = model(prompt).logits
            tokens = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
        print("generated:", tokens[0, prompt.shape[1]:].tolist())

        if args.check or args.tiny:
            plain = AutoModelForCausalLM.from_pretrained(path).eval()
            with torch.no_grad():
                expected_logits = plain(prompt).logits
                expected = plain.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
            if not torch.equal(tokens.cpu(), expected.cpu()) or not torch.equal(logits.cpu(), expected_logits):
                raise SystemExit(f"mismatch: dispatched {tokens.tolist()} vs plain {expected.tolist()}")
            print("ok: the same logits and tokens as the model loaded whole")


if __name__ == "__main__":
    main()
