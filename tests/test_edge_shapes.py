"""0-dim tensors and empty indices through scatters, gathers and the ops whose backward scatters.

PyTorch indexes a 0-dim tensor as one of one element along dim 0 (or -1) and accepts an empty index of another
rank; ONNX's ScatterElements and GatherElements do neither (Note [Scatters of a 0-dim tensor]), and the index
guards read a 0-dim tensor's size as 1. Each case compares the output and the input's gradient with eager's,
and an index out of range raises what eager raises.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ortlab

I0, I1 = torch.tensor(0), torch.tensor([0])
CASES = {
    "gather": lambda x: torch.gather(x, 0, I0),
    "gather, index [1]": lambda x: torch.gather(x, -1, I1),
    "gather, empty index of rank 2": lambda x: torch.gather(x.expand(5), 0, torch.zeros(2, 0, dtype=torch.long)),
    "scatter": lambda x: torch.scatter(x, 0, I0, x * 2),
    "scatter a value": lambda x: torch.scatter(x, 0, I0, 5.0),
    "scatter_add": lambda x: torch.scatter_add(x, 0, I0, x * 3),
    "scatter_add, empty index of rank 2": lambda x: torch.scatter_add(x.expand(5) * 1, 0,
                                                                      torch.zeros(2, 0, dtype=torch.long),
                                                                      torch.ones(2, 0)),
    "scatter_reduce amax": lambda x: torch.scatter_reduce(x, 0, I0, x * 2, "amax"),
    "scatter_reduce mean": lambda x: torch.scatter_reduce(x, 0, I0, x * 2, "mean"),
    "index_select": lambda x: torch.index_select(x, 0, I1),
    "index_select, 0-dim index": lambda x: torch.index_select(x, 0, I0),
    "max(dim)": lambda x: torch.max(x, 0)[0],
    "min(dim, keepdim)": lambda x: torch.min(x, -1, keepdim=True)[0],
    "kthvalue": lambda x: torch.kthvalue(x, 1)[0],
    "median(dim)": lambda x: torch.median(x, 0)[0],
    "nanmedian(dim)": lambda x: torch.nanmedian(x, 0, keepdim=True)[0],
    "cummax": lambda x: torch.cummax(x, 0)[0],
    "cummin": lambda x: torch.cummin(x, 0)[0],
    "sort": lambda x: torch.sort(x, 0)[0],
    "topk": lambda x: torch.topk(x, 1)[0],
}


class _Op(nn.Module):
    def __init__(self, fn) -> None:  # noqa: ANN001
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) * 1.5


@pytest.mark.parametrize("name", list(CASES))
def test_a_0_dim_tensor_scatters_and_gathers_as_in_eager(name):
    results = []
    for module in (_Op(CASES[name]), ortlab.ORTModule(_Op(CASES[name]))):
        x = torch.tensor(3.5, requires_grad=True)
        out = module(x)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    (out_e, grad_e), (out_o, grad_o) = results
    assert out_o.shape == out_e.shape and torch.equal(out_o, out_e), (out_o, out_e)
    assert torch.equal(grad_o, grad_e), (grad_o, grad_e)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_integer_and_float64_0_dim_scatters(dtype):
    fn = lambda x: torch.scatter_add(x, 0, I0, x) + torch.gather(x, 0, I1).sum()  # noqa: E731
    x = torch.tensor(7, dtype=dtype)
    torch.testing.assert_close(ortlab.ORTModule(_Op(fn))(x), _Op(fn)(x), rtol=0, atol=0)


def test_an_index_out_of_range_on_a_0_dim_tensor_raises_as_in_eager():
    fn = lambda x: torch.index_select(x, 0, torch.tensor([1]))  # noqa: E731
    with pytest.raises(IndexError, match="index out of range in self"):
        _Op(fn)(torch.tensor(1.0))
    with pytest.raises(IndexError, match="index out of range in self"):
        ortlab.ORTModule(_Op(fn))(torch.tensor(1.0))


@pytest.mark.parametrize("op", ["scatter", "scatter_add", "scatter_reduce"])
def test_a_source_larger_than_the_index_is_read_as_in_eager(op):
    index = torch.tensor([[0, 1], [2, 0]])
    fns = {"scatter": lambda x, s: torch.scatter(x, 0, index, s),
           "scatter_add": lambda x, s: torch.scatter_add(x, 0, index, s),
           "scatter_reduce": lambda x, s: torch.scatter_reduce(x, 0, index, s, "sum", include_self=False)}

    class Scatter(nn.Module):
        def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return fns[op](x, s)

    x, src = torch.zeros(3, 5), torch.arange(10.0).reshape(2, 5)
    torch.testing.assert_close(ortlab.ORTModule(Scatter())(x, src), Scatter()(x, src), rtol=0, atol=0)
    bad = torch.tensor([[0, 1], [34, 0]])
    index.copy_(bad)
    with pytest.raises(RuntimeError, match="index 34 is out of bounds for dimension 0 with size 3"):
        Scatter()(x, src)
    with pytest.raises(RuntimeError, match="index 34 is out of bounds for dimension 0 with size 3"):
        ortlab.ORTModule(Scatter())(x, src)


def test_an_empty_complex_output():
    class Complex(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.complex(a, b)

    a, b = torch.zeros(0, 1, 3), torch.zeros(0, 10, 3)
    got, expected = ortlab.ORTModule(Complex())(a, b), Complex()(a, b)
    assert got.dtype == expected.dtype == torch.complex64 and got.shape == expected.shape == (0, 10, 3)


@pytest.mark.parametrize("ord", [2, 1, 0.5, float("inf")])
def test_a_norm_over_every_dim_kept_has_eager_s_shape_and_gradient(ord):
    class Norm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.vector_norm(x, ord, keepdim=True)

    results = []
    for module in (Norm(), ortlab.ORTModule(Norm())):
        x = torch.arange(1.0, 7.0).reshape(2, 3).requires_grad_()
        out = module(x)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    assert results[1][0].shape == results[0][0].shape == (1, 1)
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])


@pytest.mark.parametrize("padding", [(-4, 5), (5, -4), (-1, 2), (-3, 1), (2, -3, -2, 4), (-6, 7, 0, 0)])
def test_a_replicate_pad_that_crops_matches_eager_to_nothing_and_beyond(padding):
    """A crop that leaves nothing, then a pad, reads the clamped edge (onnxruntime's Pad failed there)."""
    class Pad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, padding, mode="replicate") * torch.arange(1.0, 2.0)

    results = []
    for module in (Pad(), ortlab.ORTModule(Pad())):
        x = torch.arange(32.0).reshape(2, 4, 4).requires_grad_()
        out = module(x)
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
