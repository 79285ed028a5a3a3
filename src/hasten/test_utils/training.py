"""A one-feature linear regression (``y = a*x + b`` plus noise) for tests: the dataset and model
Accelerate's ``accelerate.test_utils.training`` provides, with the same fields and values."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class RegressionDataset:
    """``length`` samples ``{"x": x, "y": a*x + b + noise}`` (float32, noise of std 0.1), drawn from
    numpy's generator with ``seed``."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: Optional[int] = None) -> None:
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """``x * a + b`` with two scalar parameters; prints the dtypes of its first batch (tests of mixed
    precision read that line)."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")
            self.first_batch = False
        a, b = self.coefficients()
        return x * a + b

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slope and the intercept."""
        return self.a, self.b


class RegressionModel4XPU(RegressionModel):
    """The regression with parameters of two elements (of which the first is used): devices that
    handle 0-d parameters badly run this one."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__(a, b, double_output)
        self.a = torch.nn.Parameter(torch.tensor([a, a]).float())
        self.b = torch.nn.Parameter(torch.tensor([b, b]).float())

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a[0], self.b[0]
