"""DPO in a few lines: a trained policy beside a frozen reference, both prepared by hasten.

The policy learns to prefer "chosen" token sequences (counting upwards) to "rejected" ones (random)
while a frozen copy of its starting point, the reference, anchors it (Direct Preference
Optimization). Both are tiny GPT-2 models built from a config; the data is made here.

Run it on one process:        python examples/several_models.py
on two CPU processes:         hasten launch --cpu --num_processes 2 examples/several_models.py
with FSDP2 or DeepSpeed:      hasten launch --cpu --num_processes 2 --use_fsdp examples/several_models.py
                              hasten launch --cpu --num_processes 2 --use_deepspeed examples/several_models.py

Under DeepSpeed ZeRO-3 the reference, prepared without an optimizer, is partitioned too. save_state
holds both models; the policy's weights are written with save_model.
"""

import argparse
import copy

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import set_seed

VOCAB, LENGTH = 32, 8


def preference_pairs(n: int, seed: int) -> TensorDataset:
    """(chosen, rejected) sequences: chosen ones count upwards from a random start, rejected ones are random."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    chosen = (starts + torch.arange(LENGTH)) % VOCAB
    rejected = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    return TensorDataset(chosen, rejected)


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def sequence_logp(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Sum of the log-probabilities the model gives each next token of ``ids``."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.gather(F.log_softmax(logits, -1), 2, ids[:, 1:, None]).squeeze(2).sum(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16, help="per process")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--output_dir", default=None, help="save_state and save_model here at the end")
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    policy = tiny_gpt2()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # frozen: no optimizer, no gradients
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    loader = DataLoader(preference_pairs(512, seed=1), batch_size=args.batch_size, shuffle=True)
    # One call prepares both models; the reference has no optimizer (under ZeRO-3: a partitioned inference engine).
    policy, reference, optimizer, loader = accelerator.prepare(policy, reference, optimizer, loader)

    for epoch in range(args.epochs):
        correct = total = 0
        margins = []
        for chosen, rejected in loader:
            with torch.no_grad():
                ref_chosen, ref_rejected = sequence_logp(reference, chosen), sequence_logp(reference, rejected)
            margin = (sequence_logp(policy, chosen) - ref_chosen) - (sequence_logp(policy, rejected) - ref_rejected)
            loss = -F.logsigmoid(args.beta * margin).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            margin = accelerator.gather_for_metrics(margin.detach())
            correct += int((margin > 0).sum())
            total += margin.numel()
            margins.append(float(margin.mean()))
        accelerator.print(f"epoch {epoch}: preference accuracy {correct / total:.3f} mean margin "
                          f"{sum(margins) / len(margins):.2f} ({total} pairs, {accelerator.num_processes} process(es))")

    if args.output_dir:
        accelerator.save_state(f"{args.output_dir}/state")  # both models, the optimizer, the data position
        accelerator.save_model(policy, f"{args.output_dir}/policy")
        accelerator.print(f"saved to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
