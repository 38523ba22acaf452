"""The non-finite check: which values it catches, and the share a data-parallel rank reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.runtime import Context
from paratrain.train.nonfinite import _finite, check_finite, describe


def _ctx() -> Context:
    return Context(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                   backend=None, timeout_s=60.0)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_element_anywhere_is_caught(dtype: torch.dtype, bad: float) -> None:
    for where in (0, 517, 999):
        g = torch.ones(1000, dtype=dtype)
        g[where] = bad
        assert not _finite([torch.zeros(3, dtype=dtype), g])


def test_plus_and_minus_infinity_together_are_caught() -> None:
    g = torch.zeros(10)
    g[2], g[7] = float("inf"), float("-inf")
    assert not _finite([g])


def test_finite_values_pass_even_where_a_16_bit_sum_would_overflow() -> None:
    assert _finite([torch.full((100,), 60000.0, dtype=torch.float16)])  # fp16's max is 65504
    assert _finite([torch.full((5,), 3e38, dtype=torch.float32).double()])
    assert _finite([torch.randn(64, 32), torch.zeros(0), torch.randn(3, dtype=torch.complex64)])
    assert _finite([])


def test_complex_gradients() -> None:
    g = torch.zeros(4, dtype=torch.complex64)
    g[1] = complex(0.0, float("nan"))
    assert not _finite([g])


def _model_with_grad(values: torch.Tensor) -> nn.Module:
    m = nn.Linear(values.numel(), 1, bias=False)
    m.weight.grad = values.view(1, -1).clone()
    return m


def test_a_share_reads_only_its_part_of_each_gradient() -> None:
    g = torch.zeros(10)
    g[8] = float("nan")  # in part 1 of tensor_split(2): elements 5..9
    m, loss, ctx = _model_with_grad(g), torch.tensor(1.0), _ctx()
    assert check_finite(m, loss, ctx) == [0]
    assert check_finite(m, loss, ctx, share=(1, 2)) == [0]
    assert check_finite(m, loss, ctx, share=(0, 2)) == []  # another rank reads part 1
    assert check_finite(m, loss, ctx, share=(2, 3)) == [0]  # tensor_split(3): 7..9
    assert check_finite(m, torch.tensor(float("nan")), ctx, share=(0, 2)) == [0]  # the loss always counts


def test_the_message_names_the_parameter_on_a_rank_whose_share_was_finite() -> None:
    # under ddp/dp rank 0 may have checked the finite half of a gradient that every rank holds
    g = torch.zeros(10)
    g[8] = float("nan")
    m, ctx = _model_with_grad(g), _ctx()
    text = describe(5, [1], ctx, m, torch.tensor(0.5))
    assert "at step 5 on rank 1" in text
    assert "first non-finite parameter gradient: weight" in text
    assert "this rank's loss" not in text
