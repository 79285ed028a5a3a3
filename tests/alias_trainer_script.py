"""transformers' ``Trainer`` on a tiny GPT-2 built from a config, made-up tokens, no network. Written for
Accelerate and run unedited on hasten: tests/test_accelerate_alias.py starts it with Accelerate (``python``,
``torchrun``) and with hasten (``python -m hasten.as_accelerate``, ``HASTEN_AS_ACCELERATE=1 hasten launch``)
and compares what process 0 writes to ``--report``.

One process run holds two trainings (the process costs more than the training): an uninterrupted one of
``--max_steps`` steps that saves every ``--save_steps``, then a second Trainer (a fresh model, another
output folder) that resumes from the first one's checkpoint at ``--save_steps``. Both then ``predict`` on
10 rows (not a multiple of the global batch: ``gather_for_metrics`` must drop the padding).
Report: each run's log history, final weights and prediction summary.

``python alias_trainer_script.py OUT --report R.json [--max_steps 6] [--save_steps 3] [--cpu]``
"""

import argparse
import json
import os
import sys

import torch


def _train(args, output_dir, resume=None):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (96, 12), generator=g)
    data = [{"input_ids": row, "labels": row} for row in tokens]
    targs = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.accumulation, max_steps=args.max_steps, save_steps=args.save_steps,
        logging_steps=1, learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01,
        max_grad_norm=1.0, seed=0, report_to=[], dataloader_num_workers=0, disable_tqdm=True, eval_strategy="no",
        use_cpu=args.cpu,  # cpu-on-purpose: only when the test's device policy says so (--cpu)
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    prediction = trainer.predict(data[:10])
    weights = {k: v.detach().float().cpu().flatten().tolist() for k, v in trainer.model.state_dict().items()}
    history = [{k: v for k, v in h.items() if k in ("loss", "grad_norm", "learning_rate", "step", "epoch")}
               for h in trainer.state.log_history if "loss" in h]
    return trainer, {"history": history, "weights": weights, "global_step": trainer.state.global_step,
                     "predict_loss": prediction.metrics["test_loss"],
                     "predict_shape": list(prediction.predictions.shape),
                     "predict_sum": float(prediction.predictions.astype("float64").sum())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--report", required=True)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="TrainingArguments(use_cpu=True)")
    args = parser.parse_args()

    first = os.path.join(args.output_dir, "uninterrupted")
    trainer, uninterrupted = _train(args, first)
    _, resumed = _train(args, os.path.join(args.output_dir, "resumed"),
                        resume=os.path.join(first, f"checkpoint-{args.save_steps}"))
    if trainer.is_world_process_zero():
        import accelerate

        with open(args.report, "w") as f:
            json.dump({"accelerate": accelerate.__file__, "accelerate_version": accelerate.__version__,
                       "world_size": trainer.args.world_size, "distributed_type": str(trainer.accelerator.distributed_type),
                       "checkpoints": sorted(os.listdir(first)),
                       "uninterrupted": uninterrupted, "resumed": resumed}, f)


if __name__ == "__main__":
    sys.exit(main())
