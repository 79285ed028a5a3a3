"""tools/diffusers_harness.py's own pieces: script preparation, generated data, the torchvision stand-in,
the tiny models (those need diffusers and skip without it; the runs themselves are the harness's job,
see tools/diffusers_result.md)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.join(TOOLS, "diffusers_standin"))
import diffusers_harness as harness  # noqa: E402
import harness_transforms as transforms  # noqa: E402

needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None,
                                     reason="diffusers not installed (see tools/diffusers_harness.py)")
needs_datasets = pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                                    reason="datasets not installed (see tools/diffusers_harness.py)")

SCRIPT = '''import accelerate
import torch
from accelerate import Accelerator
from torchvision import transforms
parser.add_argument("--resolution")
if version.parse(accelerate.__version__) >= version.parse("0.16.0"):
    pass
'''


def test_prepare_script_edits_both_copies_alike_and_keeps_the_lines(tmp_path):
    examples = tmp_path / "examples"
    (examples / "demo").mkdir(parents=True)
    (examples / "demo" / "train_demo.py").write_text(SCRIPT)
    spec = harness.DiffusersSpec("demo/train_demo.py", "sd", "captions", "w.safetensors")
    ours = open(harness.prepare_script(str(examples), spec, str(tmp_path / "work"), "hasten")).read()
    theirs = open(harness.prepare_script(str(examples), spec, str(tmp_path / "work"), "accelerate")).read()
    for text in (ours, theirs):
        assert len(text.splitlines()) == len(SCRIPT.splitlines())
        assert harness.STANDIN_IMPORT in text and harness.TORCHVISION_IMPORT not in text
        assert harness.SEED_LINE in text  # the script has no --seed argument
    assert theirs.replace(harness.STANDIN_IMPORT, harness.TORCHVISION_IMPORT).replace(
        harness.SEED_LINE, "import torch") == SCRIPT
    assert ours == harness.hastenize(theirs)
    assert "import hasten\n" in ours and "hasten.__version__" in ours and "accelerate" not in ours


def test_a_script_with_a_seed_argument_is_not_seeded_by_the_harness():
    text = SCRIPT.replace('"--resolution"', '"--seed"')
    assert harness.adapt_for_harness(text).count("manual_seed") == 0


def test_the_generated_images_and_captions(tmp_path):
    harness.write_images(str(tmp_path / "captions"), with_captions=True)
    harness.write_images(str(tmp_path / "instance"), with_captions=False)
    from PIL import Image

    rows = [json.loads(line) for line in open(tmp_path / "captions" / "metadata.jsonl")]
    assert len(rows) == harness.IMAGES and len({r["text"] for r in rows}) == harness.IMAGES
    for row in rows:
        image = Image.open(tmp_path / "captions" / row["file_name"])
        assert image.size == (harness.RESOLUTION, harness.RESOLUTION) and image.mode == "RGB"
        square, _, _, ground = row["text"].split()
        assert image.getpixel((0, 0)) == harness.COLOURS[ground]
        assert image.getpixel((9, 9)) == harness.COLOURS[square]
    assert sorted(os.listdir(tmp_path / "instance")) == [r["file_name"] for r in rows]


def test_checkpoints_are_listed_in_step_order(tmp_path):
    for name in ("checkpoint-10", "checkpoint-2", "logs", "unet"):
        (tmp_path / name).mkdir()
    assert harness.checkpoints(str(tmp_path)) == ["checkpoint-2", "checkpoint-10"]
    assert harness.checkpoints(str(tmp_path / "absent")) == []


def test_weight_differences(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([0.0, 0.5, -0.25])}, str(tmp_path / "b.safetensors"))
    save_file({"v": torch.zeros(3)}, str(tmp_path / "c.safetensors"))
    a, b, c = (str(tmp_path / f"{n}.safetensors") for n in "abc")
    assert harness.max_weight_difference(a, b) == 0.5
    assert harness.max_weight_difference(a, c) == float("inf")
    assert harness.max_weight_difference(a, str(tmp_path / "absent.safetensors")) is None


def test_the_transforms_stand_in():
    from PIL import Image

    image = Image.new("RGB", (6, 4), (255, 0, 51))
    tensor = transforms.Compose([transforms.Resize(2, interpolation=transforms.InterpolationMode.BILINEAR),
                                 transforms.CenterCrop(2), transforms.ToTensor(),
                                 transforms.Normalize([0.5], [0.5])])(image)
    assert tensor.shape == (3, 2, 2)
    assert torch.allclose(tensor[:, 0, 0], torch.tensor([1.0, -1.0, 51 / 255 * 2 - 1]))
    assert transforms.PILToTensor()(image).dtype == torch.uint8
    assert transforms.ConvertImageDtype(torch.float32)(torch.full((1, 1, 1), 255, dtype=torch.uint8)).item() == 1.0
    # Random crops draw from torch's generator only when there is something to choose.
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert transforms.RandomCrop((4, 6))(image) is image and torch.equal(torch.get_rng_state(), state)
    assert transforms.RandomCrop(3)(image).size == (3, 3) and not torch.equal(torch.get_rng_state(), state)
    assert torch.equal(transforms.RandomHorizontalFlip(p=1.0)(torch.arange(3.0).view(1, 1, 3)),
                       torch.tensor([[[2.0, 1.0, 0.0]]]))


@needs_diffusers
def test_the_tiny_models_load_as_the_scripts_load_them(tmp_path):
    from diffusers import DDPMScheduler, UNet2DConditionModel, UNet2DModel
    from transformers import AutoTokenizer, CLIPTextModel

    harness.build_model("unet2d", str(tmp_path / "unet2d"))
    unet2d = UNet2DModel.from_config(UNet2DModel.load_config(str(tmp_path / "unet2d")))
    sample = torch.zeros(1, 3, harness.RESOLUTION, harness.RESOLUTION)
    assert unet2d(sample, torch.tensor([1])).sample.shape == sample.shape
    sd = str(tmp_path / "sd")
    harness.build_model("sd", sd)
    tokenizer = AutoTokenizer.from_pretrained(sd, subfolder="tokenizer", use_fast=False)
    ids = tokenizer(["red square on blue"], max_length=tokenizer.model_max_length, padding="max_length",
                    truncation=True, return_tensors="pt").input_ids
    # Character tokens between the start token and the end token that truncation keeps (no unknown one).
    assert ids.shape == (1, 16) and ids[0, 0] == tokenizer.bos_token_id and ids[0, -1] == tokenizer.eos_token_id
    assert all(i > 1 for i in ids[0, 1:-1].tolist())
    states = CLIPTextModel.from_pretrained(sd, subfolder="text_encoder")(ids)[0]
    unet = UNet2DConditionModel.from_pretrained(sd, subfolder="unet")
    latents = torch.zeros(1, 4, harness.RESOLUTION // 2, harness.RESOLUTION // 2)
    assert unet(latents, torch.tensor([1]), states).sample.shape == latents.shape
    assert DDPMScheduler.from_pretrained(sd, subfolder="scheduler").config.num_train_timesteps == 1000


@needs_datasets
def test_the_captioned_folder_loads_as_an_imagefolder(tmp_path):
    from datasets import load_dataset

    harness.write_images(str(tmp_path / "captions"), with_captions=True)
    dataset = load_dataset("imagefolder", data_files={"train": os.path.join(str(tmp_path / "captions"), "**")},
                           cache_dir=str(tmp_path / "cache"))["train"]
    assert dataset.column_names == ["image", "text"] and len(dataset) == harness.IMAGES
