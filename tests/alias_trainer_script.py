"""transformers' ``Trainer`` on a tiny GPT-2 built from a config, made-up tokens, no network. Written for
Accelerate, unedited for hasten: tests/test_accelerate_alias.py runs it with Accelerate (``python`` /
``torchrun``) and with hasten (``python -m hasten.as_accelerate`` / ``HASTEN_AS_ACCELERATE=1 hasten launch``)
and compares what process 0 writes to ``--report``: the log history and the final weights.

``python alias_trainer_script.py OUT --report R.json [--max_steps 6] [--save_steps 3] [--resume CKPT]``
"""

import argparse
import json
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--report", required=True)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (96, 12), generator=g)
    data = [{"input_ids": row, "labels": row} for row in tokens]

    targs = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=args.accumulation,
        max_steps=args.max_steps, save_steps=args.save_steps, logging_steps=1, learning_rate=5e-3,
        lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, seed=0,
        report_to=[], dataloader_num_workers=0, disable_tqdm=True,
        eval_strategy="no", use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train(resume_from_checkpoint=args.resume)
    if trainer.is_world_process_zero():
        import accelerate

        weights = {k: v.detach().float().cpu().flatten().tolist() for k, v in trainer.model.state_dict().items()}
        history = [{k: v for k, v in h.items() if k in ("loss", "grad_norm", "learning_rate", "step", "epoch")}
                   for h in trainer.state.log_history if "loss" in h]
        with open(args.report, "w") as f:
            json.dump({"accelerate": accelerate.__file__, "world_size": trainer.args.world_size,
                       "history": history, "weights": weights, "global_step": trainer.state.global_step}, f)


if __name__ == "__main__":
    sys.exit(main())
