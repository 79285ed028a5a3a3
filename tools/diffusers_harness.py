"""Run diffusers' (and PEFT's) training examples on hasten and on Accelerate, offline, side by side.

The scripts are written for Accelerate; for hasten this harness copies each one with the word
``accelerate`` replaced by ``hasten`` (``no_trainer_harness.hastenize``, nothing else of the user's code
changed), for Accelerate it copies it unchanged. It builds what the scripts need locally -- a tiny
``UNet2DModel`` config; a tiny Stable Diffusion folder (``UNet2DConditionModel``, ``AutoencoderKL``,
``CLIPTextModel``, a character-level ``CLIPTokenizer`` written from a generated vocabulary,
``DDPMScheduler``, no safety checker) saved with ``StableDiffusionPipeline.save_pretrained``; 12
generated 16x16 images (a coloured square on a coloured ground) in an ``imagefolder`` with a
``metadata.jsonl`` of captions ("red square on blue") -- and runs each script:

- ``1p``: one process (plain ``python script.py``), checkpointing every 2 steps (mid-epoch: an epoch
  is 6 steps on 1 process, 3 on 2);
- ``2p``: two CPU processes (hasten: ``hasten launch --cpu --num_processes 2``; Accelerate:
  ``torchrun --nproc_per_node 2`` with ``ACCELERATE_USE_CPU=true``, since ``accelerate launch --cpu``
  starts a single process);
- ``1p-resume`` / ``2p-resume``: a fresh output folder holding only the first checkpoint
  (``checkpoint-2``) the matching run wrote, then the same command with ``--resume_from_checkpoint
  latest`` (the scripts look for ``checkpoint-*`` in their ``--output_dir``).

A run passes when it exits 0, saves its final weights and (first runs) writes a checkpoint; a resumed
run must also end at the same last checkpoint as the run it resumes. Each resumed row gives the largest
difference between its final weights and the uninterrupted run's ("resume gap", 0 = exact); the closing
lines compare hasten's final weights with Accelerate's for each (script, mode).

torchvision: no wheel of it works with the torch installed here, so the one line ``from torchvision
import transforms`` becomes ``import harness_transforms as transforms`` in both frameworks' copies
(``adapt_for_harness``; tools/diffusers_standin/harness_transforms.py, found through
``PYTHONPATH``, has the transforms the scripts use; the harness centre-crops images that already have
the resolution and never flips, so no transform draws a random number). train_unconditional.py takes
no ``--seed`` and torch's default seed differs in every process, so its copies (both) seed torch where
they import it (``adapt_for_harness``). Nothing is downloaded (``HF_HUB_OFFLINE=1``,
``HF_DATASETS_OFFLINE=1``).

Rerunning what tools/diffusers_result.md reports::

    # 1. the scripts (outside the repository; never commit them): huggingface/diffusers at commit
    #    58eb52c0803ea9af3abec60841c2a093bdf1f951 and huggingface/peft at commit
    #    5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40, each a git directory (a clone, or the search tool's fetch)
    mkdir -p /tmp/diffusers-examples /tmp/peft-examples /tmp/dh-src
    git --git-dir=$DIFFUSERS_GIT archive HEAD examples/unconditional_image_generation examples/text_to_image \
        examples/dreambooth | tar -x -C /tmp/diffusers-examples --strip-components=1
    git --git-dir=$PEFT_GIT archive HEAD examples/lora_dreambooth | tar -x -C /tmp/peft-examples --strip-components=1
    # 2. the packages the scripts import, into a folder of their own (no torch, no CUDA wheels): diffusers
    #    built from the same commit (the scripts' check_min_version asks for 0.40.0.dev0), the rest from PyPI
    git --git-dir=$DIFFUSERS_GIT archive HEAD setup.py src | tar -x -C /tmp/dh-src
    for f in pyproject.toml README.md; do git --git-dir=$DIFFUSERS_GIT show HEAD:$f > /tmp/dh-src/$f; done
    pip install --no-deps --no-build-isolation --target /tmp/dh-deps /tmp/dh-src
    pip download --no-deps -d /tmp/dh-dl datasets peft pyarrow "dill<0.4.2" pandas "multiprocess<0.70.20"
    pip install --no-deps --target /tmp/dh-deps /tmp/dh-dl/*.whl
    # 3. the runs (hasten from this checkout, Accelerate as installed), about 20 s of CPU each:
    PYTHONPATH=$PWD/src:/tmp/dh-deps python tools/diffusers_harness.py --examples /tmp/diffusers-examples \
        --peft_examples /tmp/peft-examples --frameworks hasten,accelerate

Other options: ``--scripts`` (default: all of SPECS), ``--modes 1p,2p,1p-resume,2p-resume``,
``--work /tmp/hasten-diffusers`` (models, data, outputs under ``out/<framework>/<script>-<mode>``, logs
under ``logs/``), ``--timeout 600`` (seconds per run), ``--compare_only`` (run nothing, compare the final
weights earlier runs left in ``--work``).
Prints one table row per run and ``N passed, N failed`` (skips counted apart); exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from no_trainer_harness import (  # noqa: E402
    RunResult, add_run_arguments, chosen_runs, format_row, hastenize, last_error, launcher,
)

MODES = ("1p", "2p", "1p-resume", "2p-resume")
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "diffusers_standin")
RESOLUTION = 16
IMAGES = 12  # batch 2: 6 steps an epoch on 1 process, 3 on 2, so checkpoint-2 is mid-epoch on both
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


@dataclasses.dataclass(frozen=True)
class DiffusersSpec:
    """How to run one example: its path under the examples folder, the model folder and data it needs,
    its own arguments, and the file (relative to ``--output_dir``) that holds the trained weights."""

    path: str
    model: str  # "unet2d" (a config folder) or "sd" (a Stable Diffusion pipeline folder)
    data: str  # "captions" (imagefolder + metadata.jsonl) or "instance" (a folder of images)
    weights: str
    extra_args: tuple[str, ...] = ()
    root: str = "diffusers"  # which examples folder: "diffusers" (--examples) or "peft" (--peft_examples)
    needs: tuple[str, ...] = ("diffusers",)
    no_checkpoints: Optional[str] = None  # why the script writes no checkpoint (its resume modes are skipped)


SD_ARGS = ("--resolution", str(RESOLUTION), "--center_crop", "--train_batch_size", "2", "--num_train_epochs", "2",
           "--learning_rate", "1e-3", "--lr_scheduler", "constant", "--lr_warmup_steps", "0", "--seed", "42",
           "--report_to", "tensorboard")

SPECS: dict[str, DiffusersSpec] = {
    "unconditional": DiffusersSpec(
        "unconditional_image_generation/train_unconditional.py", "unet2d", "captions",
        "unet/diffusion_pytorch_model.safetensors",
        ("--resolution", str(RESOLUTION), "--center_crop", "--train_batch_size", "2", "--eval_batch_size", "1",
         "--num_epochs", "2", "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--ddpm_num_inference_steps", "2",
         "--save_images_epochs", "100", "--logger", "tensorboard"), needs=("diffusers", "datasets")),
    "text_to_image": DiffusersSpec(
        "text_to_image/train_text_to_image.py", "sd", "captions", "unet/diffusion_pytorch_model.safetensors",
        SD_ARGS + ("--caption_column", "text"), needs=("diffusers", "datasets")),
    "text_to_image_lora": DiffusersSpec(
        "text_to_image/train_text_to_image_lora.py", "sd", "captions", "pytorch_lora_weights.safetensors",
        SD_ARGS + ("--caption_column", "text", "--rank", "2"), needs=("diffusers", "datasets", "peft")),
    "dreambooth_lora": DiffusersSpec(
        "dreambooth/train_dreambooth_lora.py", "sd", "instance", "pytorch_lora_weights.safetensors",
        SD_ARGS + ("--instance_prompt", "a sks square", "--rank", "2", "--num_validation_images", "0"),
        needs=("diffusers", "peft")),
    # PEFT's DreamBooth example (LoRA through ``get_peft_model``, Accelerate for the loop). Its
    # ``save_state`` lines are commented out, so it writes no checkpoint: only the 1p and 2p runs.
    "peft_lora_dreambooth": DiffusersSpec(
        "lora_dreambooth/train_dreambooth.py", "sd", "instance", "unet/adapter_model.safetensors",
        SD_ARGS + ("--instance_prompt", "a sks square", "--use_lora", "--lora_r", "2", "--no_tracemalloc"),
        root="peft", needs=("diffusers", "peft", "datasets"),
        no_checkpoints="the script's save_state lines are commented out (it writes no checkpoint)"),
}


# -- models ---------------------------------------------------------------------------------------

def write_clip_tokenizer(folder: str, max_length: int = 16) -> None:
    """A character-level ``CLIPTokenizer``: every lower-case letter and digit, alone and word-final
    (``x</w>``), no merges, saved with ``save_pretrained`` (slow and fast files)."""
    import string

    from transformers import CLIPTokenizer

    os.makedirs(folder, exist_ok=True)
    chars = list(string.ascii_lowercase + string.digits)
    vocab = ["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars]
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump({token: i for i, token in enumerate(vocab)}, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"), model_max_length=max_length,
                  pad_token="<|endoftext|>").save_pretrained(folder)


def unet2d_config() -> dict:
    """A tiny ``UNet2DModel`` (two levels, attention on the lower one) for 16x16 RGB images."""
    return {"sample_size": RESOLUTION, "in_channels": 3, "out_channels": 3, "layers_per_block": 1,
            "block_out_channels": [8, 16], "norm_num_groups": 4, "attention_head_dim": 4,
            "down_block_types": ["DownBlock2D", "AttnDownBlock2D"], "up_block_types": ["AttnUpBlock2D", "UpBlock2D"]}


def build_unet2d(folder: str) -> None:
    """The ``--model_config_name_or_path`` folder of train_unconditional.py (a ``config.json``)."""
    from diffusers import UNet2DModel

    os.makedirs(folder, exist_ok=True)
    UNet2DModel(**unet2d_config()).save_config(folder)


def build_sd(folder: str) -> None:
    """A tiny Stable Diffusion pipeline folder (``model_index.json`` and one subfolder per part)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tokenizer_dir = os.path.join(folder, "tokenizer")
    write_clip_tokenizer(tokenizer_dir)
    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=8,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 8], layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=RESOLUTION)
    unet = UNet2DConditionModel(
        sample_size=RESOLUTION // 2, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=[8, 16],
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
        cross_attention_dim=8, attention_head_dim=2, norm_num_groups=4)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                              beta_end=0.012, clip_sample=False, steps_offset=1)
    StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                            safety_checker=None, feature_extractor=None,
                            requires_safety_checker=False).save_pretrained(folder)


def build_model(kind: str, folder: str) -> None:
    if kind == "unet2d":
        build_unet2d(folder)
    elif kind == "sd":
        build_sd(folder)
    else:
        raise ValueError(f"no tiny model of kind {kind!r}; known: unet2d, sd")


# -- data -----------------------------------------------------------------------------------------

def image_captions(count: int = IMAGES) -> list[tuple[str, str, str]]:
    """(file name, square colour, ground colour) of each generated image, every pair of two colours in turn."""
    names = sorted(COLOURS)
    pairs = [(a, b) for a in names for b in names if a != b]
    return [(f"{i:02d}.png", *pairs[i % len(pairs)]) for i in range(count)]


def write_images(folder: str, with_captions: bool, count: int = IMAGES) -> None:
    """``count`` RGB images of ``RESOLUTION`` pixels: a square of one colour, off centre by the image's
    index, on a ground of another. With captions a ``metadata.jsonl`` (``file_name``, ``text``) makes the
    folder a captioned ``imagefolder`` data set."""
    from PIL import Image, ImageDraw

    os.makedirs(folder, exist_ok=True)
    rows = []
    for i, (name, square, ground) in enumerate(image_captions(count)):
        image = Image.new("RGB", (RESOLUTION, RESOLUTION), COLOURS[ground])
        offset = i % 5
        ImageDraw.Draw(image).rectangle([offset + 2, offset + 2, offset + 9, offset + 9], fill=COLOURS[square])
        image.save(os.path.join(folder, name))
        rows.append({"file_name": name, "text": f"{square} square on {ground}"})
    if with_captions:
        with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def data_args(spec: DiffusersSpec, work: str) -> list[str]:
    folder = os.path.join(work, "data", spec.data)
    if not os.path.exists(folder):
        write_images(folder, with_captions=spec.data == "captions")
    return ["--instance_data_dir" if spec.data == "instance" else "--train_data_dir", folder]


def model_args(spec: DiffusersSpec, work: str) -> list[str]:
    folder = os.path.join(work, "models", spec.model)
    if not os.path.exists(os.path.join(folder, "config.json" if spec.model == "unet2d" else "model_index.json")):
        build_model(spec.model, folder)
    return ["--model_config_name_or_path" if spec.model == "unet2d" else "--pretrained_model_name_or_path", folder]


# -- runs -----------------------------------------------------------------------------------------

TORCHVISION_IMPORT = "from torchvision import transforms"
STANDIN_IMPORT = "import harness_transforms as transforms  # harness: torchvision stand-in"


SEED_LINE = "import torch; torch.manual_seed(0)  # harness: the script takes no --seed"


def adapt_for_harness(source: str) -> str:
    """The script's text with the two edits the harness makes for both frameworks alike (the line count
    is kept, so tracebacks name the original lines): the torchvision import pointed at the stand-in, and,
    for a script without a ``--seed`` argument (train_unconditional.py), torch's global generator seeded
    where the script imports torch. torch's default seed is drawn anew in every process, so without it two
    runs of the same script start from different weights and noise and cannot be compared."""
    source = source.replace(TORCHVISION_IMPORT, STANDIN_IMPORT)
    if '"--seed"' not in source:
        source = re.sub(r"^import torch$", SEED_LINE, source, count=1, flags=re.M)
    return source


def prepare_script(examples: str, spec: DiffusersSpec, work: str, framework: str = "hasten") -> str:
    """Copy the script into ``work/scripts/<framework>`` (torchvision import pointed at the stand-in,
    alike for both; for hasten also the word replaced); returns its path."""
    folder = os.path.join(work, "scripts", framework)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(examples, spec.path)) as f:
        text = adapt_for_harness(f.read())
    target = os.path.join(folder, os.path.basename(spec.path))
    with open(target, "w") as f:
        f.write(hastenize(text) if framework == "hasten" else text)
    return target


def checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders a run left in ``output_dir``, in step order."""
    if not os.path.isdir(output_dir):
        return []
    return sorted((d for d in os.listdir(output_dir) if re.fullmatch(r"checkpoint-\d+", d)),
                  key=lambda d: int(d.split("-")[1]))


def output_dir_of(work: str, framework: str, name: str, mode: str) -> str:
    return os.path.join(work, "out", framework, f"{name}-{mode}")


def max_weight_difference(path_a: str, path_b: str) -> Optional[float]:
    """Largest absolute difference between two safetensors files (None: one is missing; inf: other keys)."""
    if not (os.path.exists(path_a) and os.path.exists(path_b)):
        return None
    from safetensors.torch import load_file

    a, b = load_file(path_a), load_file(path_b)
    if sorted(a) != sorted(b):
        return float("inf")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)


def run_env(work: str) -> dict:
    path = os.pathsep.join(p for p in (STANDIN, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_DATASETS_CACHE=os.path.join(work, "datasets-cache"), HF_HOME=os.path.join(work, "hf-home"),
                TOKENIZERS_PARALLELISM="false", ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1",
                DIFFUSERS_VERBOSITY="error")


def run_one(name: str, spec: DiffusersSpec, script: str, mode: str, base_args: list[str], work: str, timeout: int,
            framework: str = "hasten") -> RunResult:
    """Run ``script`` in ``mode``; see the module docstring for what passes."""
    processes = 2 if mode.startswith("2p") else 1
    output_dir = output_dir_of(work, framework, name, mode)
    whole_dir = output_dir_of(work, framework, name, mode.split("-")[0])
    shutil.rmtree(output_dir, ignore_errors=True)
    args = base_args + ["--output_dir", output_dir, "--checkpointing_steps", "2"]
    if mode.endswith("resume") and spec.no_checkpoints:
        return RunResult(name, mode, "skip", note=spec.no_checkpoints, framework=framework)
    if mode.endswith("resume"):
        found = checkpoints(whole_dir)
        if not found:
            return RunResult(name, mode, "FAIL", note="the run to resume left no checkpoint", framework=framework)
        shutil.copytree(os.path.join(whole_dir, found[0]), os.path.join(output_dir, found[0]))
        args += ["--resume_from_checkpoint", "latest"]
    log_path = os.path.join(work, "logs", f"{framework}-{name}-{mode}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(launcher(framework, processes) + [script] + args, cwd=work, env=run_env(work),
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.monotonic() - start
    if code is None:
        return RunResult(name, mode, "FAIL", seconds, f"timed out after {timeout} s; log {log_path}", framework)
    problems = [] if code == 0 else [f"exit {code}: {last_error(log_path)}"]
    weights = os.path.join(output_dir, spec.weights)
    if code == 0 and not os.path.exists(weights):
        problems.append(f"no final weights ({spec.weights})")
    ours, whole = checkpoints(output_dir), checkpoints(whole_dir)
    if code == 0 and not mode.endswith("resume") and not ours and not spec.no_checkpoints:
        problems.append("no checkpoint written")
    remarks = []
    if code == 0 and mode.endswith("resume"):
        if whole and ours[-1:] != whole[-1:]:
            problems.append(f"resumed run ended at {ours[-1]}, the whole run at {whole[-1]}")
        gap = max_weight_difference(os.path.join(whole_dir, spec.weights), weights)
        remarks += [] if gap is None else [f"resume gap {gap:.1e}"]
    return RunResult(name, mode, "FAIL" if problems else "pass", seconds, "; ".join(problems + remarks), framework)


def missing_requirement(spec: DiffusersSpec, examples: Optional[str]) -> Optional[str]:
    """Why ``spec`` cannot run here (no examples folder, a missing file or package), else None."""
    if not examples:
        return f"no {spec.root} examples folder given"
    if not os.path.exists(os.path.join(examples, spec.path)):
        return f"{spec.path} not found under {examples}"
    import importlib.util

    absent = [pkg for pkg in spec.needs if importlib.util.find_spec(pkg) is None]
    return f"needs {', '.join(absent)} (see the module docstring)" if absent else None


def run_harness(roots: dict[str, Optional[str]], names: list[str], modes: list[str], work: str, timeout: int,
                frameworks: tuple[str, ...] = ("hasten",)) -> list[RunResult]:
    """Every (script, framework, mode) run; a script that cannot run here is one ``skip`` row with its reason.
    ``roots`` maps ``diffusers`` / ``peft`` to their examples folders."""
    os.makedirs(work, exist_ok=True)
    results = []
    for name in names:
        spec = SPECS[name]
        examples = roots.get(spec.root)
        reason = missing_requirement(spec, examples)
        if reason:
            results.append(RunResult(name, "all", "skip", note=reason))
            continue
        base_args = model_args(spec, work) + data_args(spec, work) + list(spec.extra_args)
        for framework in frameworks:
            script = prepare_script(examples, spec, work, framework)
            for mode in modes:
                result = run_one(name, spec, script, mode, base_args, work, timeout, framework)
                print(format_row(result), flush=True)
                results.append(result)
    return results


def compare_frameworks(names: list[str], modes: list[str], work: str) -> list[str]:
    """One line per (script, mode) whose final weights both frameworks left in ``work`` (this run's or
    an earlier one's): the largest difference between hasten's and Accelerate's."""
    lines = []
    for script in names:
        for mode in modes:
            weights = SPECS[script].weights
            gap = max_weight_difference(os.path.join(output_dir_of(work, "hasten", script, mode), weights),
                                        os.path.join(output_dir_of(work, "accelerate", script, mode), weights))
            if gap is not None:
                lines.append(f"{script} {mode}: hasten vs accelerate weights max |diff| {gap:.1e}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", help="a diffusers checkout's examples folder (the scripts are read from there)")
    parser.add_argument("--peft_examples", help="a peft checkout's examples folder")
    add_run_arguments(parser, SPECS, MODES, "/tmp/hasten-diffusers")
    parser.add_argument("--compare_only", action="store_true",
                        help="run nothing; compare the final weights earlier runs left in --work")
    args = parser.parse_args(argv)
    names, modes, frameworks = chosen_runs(parser, args, SPECS, MODES)
    for flag, folder in (("--examples", args.examples), ("--peft_examples", args.peft_examples)):
        if folder and not os.path.isdir(folder):
            parser.error(f"{flag} {folder!r} is not a folder; give a checkout's examples folder")
    roots = {"diffusers": args.examples and os.path.abspath(args.examples),
             "peft": args.peft_examples and os.path.abspath(args.peft_examples)}
    work = os.path.abspath(args.work)
    if args.compare_only:
        print("\n".join(compare_frameworks(names, modes, work)))
        return 0
    print("| script | framework | mode | result | secs | metrics | note |\n|---|---|---|---|---|---|---|", flush=True)
    results = run_harness(roots, names, modes, work, args.timeout, frameworks)
    for result in results:
        if result.status == "skip" and result.mode == "all":  # the others were printed as they came
            print(format_row(result))
    for line in compare_frameworks(names, modes, work):
        print(line)
    passed = sum(r.status == "pass" for r in results)
    failed = sum(r.status == "FAIL" for r in results)
    print(f"{passed} passed, {failed} failed, {sum(r.status == 'skip' for r in results)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
