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
    [dict(stride=1, padding=1, dilation=1), dict(stride=2, padding=0, dilation=2), dict(stride=3, padding=2, dilation=1)],
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


def test_grouped_convolution_backward_stays_in_pytorch_with_reason():
    torch.manual_seed(0)
    model = nn.Conv2d(4, 4, 3, groups=2)
    om = ortlab.ORTModule(copy.deepcopy(model))
    x = torch.randn(1, 4, 6, 6)
    with pytest.warns(ortlab.FallbackWarning, match="convolution_backward"):
        om(x).sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(om.weight.grad, model.weight.grad, rtol=RTOL, atol=ATOL)
