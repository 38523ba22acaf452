"""``mean``'s division in the shm reductions: a power of two multiplies by its reciprocal, which must equal
the division bit for bit (subnormals, infinities and signed zeros included)."""

from __future__ import annotations

import pytest
import torch

from paratrain.comm.shm.ops import divide_

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT[t.element_size()])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64]
)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 7, 64])
def test_divide_equals_true_division(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4096, generator=g, dtype=torch.float64) * torch.logspace(
        -300, 300, 4096, dtype=torch.float64
    )
    x[:7] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 5e-324, -5e-324, 1e-310])
    t = x.to(dtype)
    got = t.clone()
    divide_(got, n)
    assert torch.equal(_bits(got), _bits(t / n))
