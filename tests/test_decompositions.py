"""ortlab's own decompositions (capture/decompositions.py) match eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ortlab

RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize(
    "cfg",
    [dict(stride=1, padding=1, dilation=1), dict(stride=2, padding=0, dilation=2), dict(stride=3, padding=2, dilation=1),
     dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2)), dict(stride=2, padding=2, dilation=2)],
)
def test_convolution_backward_runs_in_onnxruntime_and_matches(cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, **cfg), nn.ReLU(), nn.Conv2d(5, 4, (3, 2), padding=1), nn.Flatten())
    x = torch.randn(2, 3, 11, 9, requires_grad=True)
    om = ortlab.ORTModule(copy.deepcopy(model))
    x2 = x.detach().clone().requires_grad_()
    out, ref = om(x2), model(x)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
    assert not om.report.fallbacks
    # Note [Convolution gradients as GEMMs]: input gradients are a GEMM and a Col2Im, not ConvTranspose.
    (backward,) = [g for c in om.report.captures for g in c.graphs if g.name == "backward"]
    assert "ConvTranspose" not in backward.onnx_ops and backward.onnx_ops.get("Col2Im", 0) >= 1


@pytest.mark.parametrize("kernel,stride,padding", [(7, 2, 3), (1, 2, 0), (3, 1, 1)])
def test_resnet_shaped_convolution_gradients_match(kernel, stride, padding):
    """A ResNet's stem (7x7, stride 2: weight gradient as a convolution), its 1x1 stride-2 shortcut and a
    3x3 block (weight gradients as one GEMM over patches) against eager, input gradient included."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 8, kernel, stride, padding, bias=False)
    x = torch.randn(2, 3, 17, 16, requires_grad=True)
    om = ortlab.ORTModule(copy.deepcopy(model))
    x2 = x.detach().clone().requires_grad_()
    om(x2).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(om.weight.grad, model.weight.grad, rtol=RTOL, atol=ATOL)
    assert not om.report.fallbacks


def test_grouped_convolution_backward_stays_in_pytorch_with_reason():
    torch.manual_seed(0)
    model = nn.Conv2d(4, 4, 3, groups=2)
    om = ortlab.ORTModule(copy.deepcopy(model))
    x = torch.randn(1, 4, 6, 6)
    with pytest.warns(ortlab.FallbackWarning, match="convolution_backward"):
        om(x).sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(om.weight.grad, model.weight.grad, rtol=RTOL, atol=ATOL)
