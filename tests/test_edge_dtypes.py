"""Integer, bool and creation ops whose dtype, length or error was not eager's (OpInfo sweep, issue 42).

Each case runs in eager and through ORTModule and compares dtype, shape and values exactly (NaN in place), or
the exception class and message.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab


class _Fn(nn.Module):
    def __init__(self, fn) -> None:  # noqa: ANN001
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


M = torch.arange(50).reshape(5, 10)
CASES = {
    # integer addmv takes beta and alpha as integers (0.2 -> 0, 0.6 -> 0)
    "addmv int64, float beta and alpha": (lambda a, m, v: torch.addmv(a, m, v, beta=0.2, alpha=0.6),
                                          (torch.tensor(3), M, torch.arange(10))),
    "addmv int64, beta 2.7 alpha 3": (lambda a, m, v: torch.addmv(a, m, v, beta=2.7, alpha=3),
                                      (torch.tensor(3), M, torch.arange(10))),
    # copysign of integers and bools is the default float
    "copysign int64": (lambda a, b: torch.copysign(a, b), (torch.tensor([[1, -2, 0, 0]]), torch.tensor([-1, 0, -3, 2]))),
    "copysign bool, a number": (lambda a: torch.copysign(a, -1.0), (torch.tensor([True, False]),)),
    "copysign bool": (lambda a, b: torch.copysign(a, b), (torch.tensor([True, False]), torch.tensor([False, True]))),
    # an integer 0 is +0.0: atan2(0, negative) is +pi
    "atan2 int64": (lambda a, b: torch.atan2(a, b), (torch.tensor([0, 0, 1, -1, 0, -5]), torch.tensor([-3, 3, 0, 0, 0, -1]))),
    "atan2 int64 and float32": (lambda a, b: torch.atan2(a, b), (torch.tensor([0, -2]), torch.tensor([-1.5, -0.0]))),
    # PyTorch's integer linspace: truncated ends, halves from each end
    "linspace int64, tensor end": (lambda e: torch.linspace(4.3, e, 50, dtype=torch.int64), (torch.tensor(-40.0),)),
    "linspace int32": (lambda x: torch.linspace(-7, 100, 13, dtype=torch.int32) + x, (torch.tensor(0, dtype=torch.int32),)),
    # float arange counts its length in double: (1.1 - 0.1) / 1 is 1 element
    "arange float32": (lambda x: torch.arange(0.1, 1.1) + x, (torch.tensor(0.0),)),
    "arange float32, step 0.1": (lambda x: torch.arange(0.1, 1.1, 0.1) + x, (torch.tensor(0.0),)),
    "arange float64": (lambda x: torch.arange(-1.0, 2.5, 0.7, dtype=torch.float64) + x, (torch.tensor(0.0, dtype=torch.float64),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dtype_length_and_values_are_eager_s(name):
    fn, args = CASES[name]
    expected = _Fn(fn)(*args)
    got = ortlab.ORTModule(_Fn(fn))(*args)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
    if expected.is_floating_point():
        torch.testing.assert_close(got, expected, rtol=1.3e-6, atol=1e-7, equal_nan=True)
        zeros = expected == 0
        assert torch.equal(got[zeros].signbit(), expected[zeros].signbit())
    else:
        assert torch.equal(got, expected), (got, expected)


def test_masked_scatter_with_a_uint8_mask_raises_eager_s_error():
    fn = lambda x, m, s: x.masked_scatter(m, s)  # noqa: E731
    args = (torch.zeros(1, 3), torch.tensor([[1, 0, 1]], dtype=torch.uint8), torch.ones(3, 4))
    message = "masked_scatter_ only supports boolean masks, but got mask with dtype Byte"
    with pytest.raises(RuntimeError, match=message):
        _Fn(fn)(*args)
    with pytest.raises(RuntimeError, match=message):
        ortlab.ORTModule(_Fn(fn))(*args)
    bool_args = (args[0], args[1].bool(), args[2])
    torch.testing.assert_close(ortlab.ORTModule(_Fn(fn))(*bool_args), _Fn(fn)(*bool_args), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ignored_rows_get_a_positive_zero_gradient_from_cross_entropy(dtype):
    """Note [nll_loss's gradient zero where eager's kernel writes nothing]: +0.0 everywhere but the kept targets."""
    x = torch.randn(4, 5, dtype=dtype)
    target = torch.tensor([0, 1, 1, 3])
    grads = []
    for module in (_Fn(lambda a, t: F.cross_entropy(a, t, ignore_index=1)),
                   ortlab.ORTModule(_Fn(lambda a, t: F.cross_entropy(a, t, ignore_index=1)))):
        a = x.clone().requires_grad_()
        module(a, target).backward(torch.tensor(-0.7, dtype=dtype))
        grads.append(a.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert torch.equal(grads[1].signbit(), grads[0].signbit()), grads
