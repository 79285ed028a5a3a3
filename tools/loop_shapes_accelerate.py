"""Run the loop-shape matrix of ``tests/checks_loop_shapes.py`` under Accelerate (or hasten) in one
process and print, per shape, how far the result is from the plain PyTorch loop.

    python tools/loop_shapes_accelerate.py --framework accelerate --backend plain
    python tools/loop_shapes_accelerate.py --framework accelerate --backend zero2
    PYTHONPATH=src python tools/loop_shapes_accelerate.py --framework hasten --backend zero2

Each shape gets a fresh Accelerator; the numbers are the largest weight difference after the last
step (relative to the tensor's scale), whether every clip norm matched, what the eval forward and
the state dict saw against torch, and any error (one line). Nothing here judges: it records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _reset(framework: str) -> None:
    if framework == "hasten":
        from distributed import reset_state

        reset_state()
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerator(framework: str, backend: str, accum: int):
    _reset(framework)
    mod = __import__(framework)
    if backend == "plain":
        return mod.Accelerator(gradient_accumulation_steps=accum, cpu=True)
    from checks_loop_shapes import PER_RANK

    plugin_cls = mod.DeepSpeedPlugin
    config = {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_accumulation_steps": accum,
              "gradient_clipping": "auto", "zero_optimization": {"stage": int(backend[4:])}}
    return mod.Accelerator(gradient_accumulation_steps=accum, deepspeed_plugin=plugin_cls(hf_ds_config=config))


def run(framework: str, backend: str) -> dict:
    import torch
    from torch import nn

    import checks_loop_shapes as c

    ref_backend = "ddp" if backend == "plain" else backend
    out = {}
    for shape in c.shapes(ref_backend):
        name = c.name_of(shape)
        row: dict = {}
        try:
            acc = _accelerator(framework, backend, shape["accum"])
            model = c._model()
            opt = torch.optim.SGD(model.parameters(), lr=c.LR, momentum=0.9)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, c._schedule) if shape["sched"] else None
            objs = acc.prepare(*([model, opt] + ([sched] if sched is not None else [])))
            model, opt = objs[0], objs[1]
            sched = objs[2] if sched is not None else None
            ref = c.reference(shape, ref_backend, 1, acc.device)
            norms, evals, sds = [], [], []
            for i, (x, y) in enumerate(c._batches(c.STEPS * shape["accum"], 1)):
                x, y = x.to(acc.device), y.to(acc.device)
                with acc.accumulate(model):
                    acc.backward(nn.functional.mse_loss(model(x), y))
                    if acc.sync_gradients:
                        if shape["between"] == "eval":
                            with torch.no_grad():
                                evals.append(model(x[:c.PER_RANK]).sum().item())
                        if shape["between"] == "state_dict":
                            sds.append({k: v.detach().cpu().clone() for k, v in acc.get_state_dict(model).items()})
                        if shape["between"] == "save" and i // shape["accum"] == 1:
                            with tempfile.TemporaryDirectory() as d:
                                try:
                                    acc.save_state(os.path.join(d, "ckpt"))
                                except Exception as e:  # noqa: BLE001 - recorded
                                    row["save"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                        if shape["clip"]:
                            n = acc.clip_grad_norm_(model.parameters(), c.CLIP)
                            norms.append(None if n is None else float(n))
                    if shape["step"]:
                        opt.step()
                    if sched is not None:
                        sched.step()
                    if shape["step"]:
                        opt.zero_grad()
            got = {k: v.detach().cpu() for k, v in acc.get_state_dict(model).items()}
            want = ref["weights"][-1]
            row["weights"] = max(float((got[k].float() - want[k]).abs().max()) / max(1.0, float(want[k].abs().max()))
                                 for k in want)
            if shape["clip"]:
                row["norms_match"] = all(a is not None and abs(a - b) <= 1e-5 * max(1.0, b)
                                         for a, b in zip(norms, ref["norms"]))
            if evals:
                row["eval"] = max(abs(a - b) for a, b in zip(evals, ref["eval"]))
            if sds:
                row["state_dict"] = max(float((s[k].float() - r[k]).abs().max()) for s, r in zip(sds, ref["state_dict"])
                                        for k in r)
        except Exception as e:  # noqa: BLE001 - recorded per shape
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["accelerate", "hasten"], default="accelerate")
    parser.add_argument("--backend", default="plain", help="plain, zero1, zero2 or zero3")
    args = parser.parse_args()
    # No ACCELERATE_USE_CPU: with it Accelerate leaves DeepSpeed out (DistributedType.NO) even with a plugin.
    # One process as torchrun would describe it (else DeepSpeed looks for MPI to find its rank).
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    run(args.framework, args.backend)


if __name__ == "__main__":
    main()
