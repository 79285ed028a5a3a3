"""``torchvision.transforms`` as far as diffusers' training examples use it, on PIL images and tensors.

No torchvision wheel works with the torch installed here, so tools/diffusers_harness.py rewrites the
scripts' ``from torchvision import transforms`` to ``import harness_transforms as transforms`` for both
frameworks alike and puts this folder on ``PYTHONPATH``. (A stand-in named ``torchvision`` would be
found by transformers' ``is_torchvision_available()``, which only looks for the module, and send its
image utilities down paths this module does not cover.)

Random transforms draw from torch's global generator the way torchvision's do (``RandomCrop`` one
``randint`` per side unless the image already has the crop's size, ``RandomHorizontalFlip`` one
``rand``), so a script keeps the random draws it would make with torchvision.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_PIL = {InterpolationMode.NEAREST: Image.NEAREST, InterpolationMode.NEAREST_EXACT: Image.NEAREST,
        InterpolationMode.BILINEAR: Image.BILINEAR, InterpolationMode.BICUBIC: Image.BICUBIC,
        InterpolationMode.BOX: Image.BOX, InterpolationMode.HAMMING: Image.HAMMING,
        InterpolationMode.LANCZOS: Image.LANCZOS}


def _size(image: Any) -> tuple[int, int]:
    """(height, width) of a PIL image or a ``(..., H, W)`` tensor."""
    return (image.height, image.width) if isinstance(image, Image.Image) else tuple(image.shape[-2:])


def _crop(image: Any, top: int, left: int, height: int, width: int) -> Any:
    if isinstance(image, Image.Image):
        return image.crop((left, top, left + width, top + height))
    return image[..., top:top + height, left:left + width]


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))


class Compose:
    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class Lambda:
    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, image: Any) -> Any:
        return self.fn(image)


class Resize:
    """An int resizes the shorter side to it (aspect kept), a pair resizes to (height, width)."""

    def __init__(self, size: int | Sequence[int], interpolation: InterpolationMode = InterpolationMode.BILINEAR):
        self.size, self.interpolation = size, interpolation

    def __call__(self, image: Any) -> Any:
        height, width = _size(image)
        if isinstance(self.size, int):
            short, long = sorted((height, width))
            new_short, new_long = self.size, int(self.size * long / short)
            target = (new_short, new_long) if height <= width else (new_long, new_short)
        else:
            target = _pair(self.size)
        if target == (height, width):
            return image
        if isinstance(image, Image.Image):
            return image.resize((target[1], target[0]), _PIL[self.interpolation])
        batched = image if image.dim() == 4 else image.unsqueeze(0)
        out = torch.nn.functional.interpolate(batched, size=target, mode=self.interpolation.value,
                                              antialias=self.interpolation == InterpolationMode.BILINEAR)
        return out if image.dim() == 4 else out.squeeze(0)


class CenterCrop:
    def __init__(self, size: int | Sequence[int]):
        self.size = _pair(size)

    def __call__(self, image: Any) -> Any:
        height, width = _size(image)
        th, tw = self.size
        return _crop(image, int(round((height - th) / 2.0)), int(round((width - tw) / 2.0)), th, tw)


class RandomCrop:
    def __init__(self, size: int | Sequence[int]):
        self.size = _pair(size)

    def __call__(self, image: Any) -> Any:
        height, width = _size(image)
        th, tw = self.size
        if (height, width) == (th, tw):
            return image
        top = int(torch.randint(0, height - th + 1, size=(1,)).item())
        left = int(torch.randint(0, width - tw + 1, size=(1,)).item())
        return _crop(image, top, left, th, tw)


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, image: Any) -> Any:
        if torch.rand(1) < self.p:
            return image.transpose(Image.FLIP_LEFT_RIGHT) if isinstance(image, Image.Image) else image.flip(-1)
        return image


class PILToTensor:
    """A PIL image as a ``(C, H, W)`` tensor of its own dtype (no scaling)."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        array = np.array(image, copy=True)
        return torch.from_numpy(array if array.ndim == 3 else array[:, :, None]).permute(2, 0, 1).contiguous()


class ToTensor:
    """A PIL image as a float ``(C, H, W)`` tensor in [0, 1] (8-bit images divided by 255)."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        tensor = PILToTensor()(image)
        return tensor.float().div(255) if tensor.dtype == torch.uint8 else tensor.float()


class ConvertImageDtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.is_floating_point() or not self.dtype.is_floating_point:
            return image.to(self.dtype)
        return image.to(self.dtype) / torch.iinfo(image.dtype).max


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean, self.std = list(mean), list(std)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std
