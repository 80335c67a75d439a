"""Float64 models keep float64 precision, outputs stay fresh tensors, pass-through graphs run.

Each case failed before its fix: torchlib made every Python number a float32 constant
(``x * 0.3`` in float64 was off by 2.8e-8; float64 MultiheadAttention gradients by 1e-8),
``x.clone()`` returned ``x`` itself, and a graph whose outputs are all its inputs
(``dropout`` in eval) could not get an onnxruntime session.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ortlab

C = 0.3  # not exact in float32

CASES = {
    "mul": lambda x: x * C,
    "div": lambda x: x / C,
    "rsub": lambda x: C - x,
    "full": lambda x: torch.full((3, 6), C, dtype=x.dtype) + x,
    "masked_fill": lambda x: x.masked_fill(x > 0, C),
    "where": lambda x: torch.where(x > 0, x, C),
    "pow": lambda x: x.abs().pow(1.3),
    "rpow": lambda x: torch.pow(1.3, x),
    "leaky_relu": lambda x: F.leaky_relu(x, C),
    "elu": lambda x: F.elu(x, C),
    "selu": F.selu,
    "hardswish": F.hardswish,
    "softplus": lambda x: F.softplus(x, beta=1.3),
    "addcmul": lambda x: torch.addcmul(x, x, x, value=C),
    "add_alpha": lambda x: torch.add(x, x * 2, alpha=C),
    "linspace": lambda x: x + torch.linspace(0, C, 6, dtype=x.dtype),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "var": lambda x: x.var(-1),
    "erf": torch.erf,
    "layer_norm": lambda x: F.layer_norm(x, (6,), eps=1e-5 * C),
    "group_norm": lambda x: F.group_norm(x.view(3, 6, 1) * 2, 2).view(3, 6),
    "smooth_l1": lambda x: F.smooth_l1_loss(x, x * 0, beta=C),
    # constants of the translation's own, or float32 inside it
    "celu": F.celu,
    "sinc": torch.sinc,
    "deg2rad": torch.deg2rad,
    "log2": lambda x: torch.log2(x.abs()),
    "log10": lambda x: torch.log10(x.abs()),
    "norm_p3": lambda x: torch.linalg.vector_norm(x, 3, -1),
    "normalize_p3": lambda x: F.normalize(x, p=3),
    "dist": lambda x: torch.dist(x, x.flip(0), p=1.5),
    "addmm": lambda x: torch.addmm(x[:, :3], x, x.T, beta=C, alpha=1.3),
}


class Fn(nn.Module):
    def __init__(self, fn) -> None:  # noqa: ANN001
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


@pytest.mark.parametrize("name", list(CASES))
def test_float64_keeps_its_precision(name):
    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64)
    xe, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ortlab.FallbackWarning)  # ops whose numbers cannot be exact run in PyTorch
        out_o = ortlab.ORTModule(Fn(CASES[name]))(xo)
    out_e = Fn(CASES[name])(xe)
    out_o.sum().backward()
    out_e.sum().backward()
    torch.testing.assert_close(out_o, out_e, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(xo.grad, xe.grad, rtol=1e-13, atol=1e-14)


def test_inexact_float64_numbers_run_in_pytorch_with_a_reason():
    om = ortlab.ORTModule(Fn(lambda x: F.leaky_relu(x, C)))
    with pytest.warns(ortlab.FallbackWarning, match="float32"):
        om(torch.randn(3, 6, dtype=torch.float64))
    (fb,) = om.report.fallbacks
    assert fb.op == "aten.leaky_relu" and fb.kind == "known_wrong"
    # float32 keeps onnxruntime's LeakyRelu, and exact numbers do in float64 too
    for dtype, slope in ((torch.float32, C), (torch.float64, 0.5)):
        om = ortlab.ORTModule(Fn(lambda x, s=slope: F.leaky_relu(x, s)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ortlab.FallbackWarning)
            om(torch.randn(3, 6, dtype=dtype))
        assert not om.report.fallbacks


def test_multihead_attention_float64_gradients():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(6, 2, batch_first=True).double()
    e = ortlab.ORTModule(m), m
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    outs, grads = [], []
    for mod, ref in ((e[0], e[0].module), (nn.MultiheadAttention(6, 2, batch_first=True).double(), None)):
        if ref is None:
            mod.load_state_dict(m.state_dict())
            ref = mod
        out, _ = mod(x, x, x, need_weights=False)
        out.sum().backward()
        outs.append(out.detach())
        grads.append(ref.in_proj_weight.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-13)


def test_a_clone_is_a_fresh_tensor():
    om = ortlab.ORTModule(Fn(lambda x: x.clone()))
    x = torch.randn(3)
    y = om(x)
    assert y.data_ptr() != x.data_ptr()
    y.add_(1)
    assert not torch.equal(x, y)


def test_graphs_that_only_pass_inputs_through_run_in_onnxruntime():
    om = ortlab.ORTModule(Fn(lambda x: F.dropout(x, 0.3, training=False)))
    x = torch.randn(3, 6, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ortlab.FallbackWarning)
        om(x).sum().backward()
    assert not om.report.fallbacks
    torch.testing.assert_close(x.grad, torch.ones(3, 6))


def test_group_norm_on_an_empty_batch():
    torch.manual_seed(0)
    m = nn.GroupNorm(2, 4)
    om = ortlab.ORTModule(nn.GroupNorm(2, 4))
    om.module.load_state_dict(m.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ortlab.FallbackWarning)
        for batch in (0, 2, 0):  # an empty batch alone, and after a full one
            x = torch.randn(batch, 4, 3, requires_grad=True)
            xe = x.detach().clone().requires_grad_()
            out, out_e = om(x), m(xe)
            out.sum().backward()
            out_e.sum().backward()
            torch.testing.assert_close(out, out_e)
            torch.testing.assert_close(x.grad, xe.grad)
    assert not om.report.fallbacks  # an empty batch goes through torch's decomposition
