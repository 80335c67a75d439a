"""Outputs that alias each other, an input or a parameter alias exactly as in eager: the same storage, offsets
and strides, with and without grad, and gradients through them (Note [Outputs that alias] in
ortlab/pipeline/graph.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_ran_in_ort, twin
from torch import nn

import ortlab


def _layout(outs: tuple, inputs: tuple) -> list[tuple]:
    """Per output: which input or earlier output it shares storage with (or None), its offset and strides."""
    seen = [("input", i, t) for i, t in enumerate(inputs)]
    out = []
    for k, t in enumerate(outs):
        ptr = t.untyped_storage().data_ptr()
        shares = next(((kind, i) for kind, i, s in seen if s.untyped_storage().data_ptr() == ptr), None)
        out.append((shares, t.storage_offset(), t.stride(), tuple(t.shape)))
        seen.append(("output", k, t))
    return out


def _same(eager_outs: tuple, ort_outs: tuple, eager_inputs: tuple, ort_inputs: tuple) -> None:
    assert _layout(ort_outs, ort_inputs) == _layout(eager_outs, eager_inputs)
    for e, o in zip(eager_outs, ort_outs):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)


class _Views(nn.Module):
    """The reliability issue's repro: an output and two views of it."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        y = self.l(x)
        z = y.view(2, 2, 4)
        return y, z, z[0]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_views_of_an_output_share_its_storage(grad: bool) -> None:
    eager, om = twin(_Views(), fallback="raise")
    x = torch.randn(4, 4)
    outs = []
    for m in (eager, om):
        with torch.set_grad_enabled(grad):
            outs.append(m(x))
    _same(outs[0], outs[1], (x,), (x,))
    if grad:
        for m, (y, _, z0) in zip((eager, om), outs):
            (y.pow(2).sum() + (z0 * torch.arange(8.0).view(2, 4)).sum()).backward()
        for pe, po in zip(eager.parameters(), om.parameters()):
            torch.testing.assert_close(po.grad, pe.grad)
    with torch.no_grad():  # a write through one output is seen through the others
        for y, z, z0 in outs:
            z0.zero_()
    _same(outs[0], outs[1], (x,), (x,))
    notes = [n for c in om.report.captures for g in c.graphs for n in g.notes]
    assert any("Note [Outputs that alias]" in n for n in notes), notes
    assert_ran_in_ort(om)


class _BatchViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        y = self.l(x)
        z = y.view(y.shape[0] // 2, 2, 4)  # symbolic: AOTAutograd cannot replay it itself
        return y, z, z[1]


def test_write_through_a_view_then_backward() -> None:
    """With a symbolic batch too, a view of an output is where eager has it, and an in-place write through it is
    part of the gradient, as in eager."""
    eager, om = twin(_BatchViews(), fallback="raise")
    for b in (4, 6, 8):
        x = torch.randn(b, 4)
        outs = []
        for m in (eager, om):
            y, z, z1 = m(x)
            outs.append((y, z, z1))
            z1.mul_(3.0)
            (y * torch.arange(4.0 * b).view(b, 4)).sum().backward()
        _same(outs[0], outs[1], (x,), (x,))
        for pe, po in zip(eager.parameters(), om.parameters()):
            torch.testing.assert_close(po.grad, pe.grad)


class _InputViews(nn.Module):
    """Views of an input and of a parameter, with sizes from the (symbolic) batch."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        return self.l(x), x[1], x.t(), x.view(x.shape[0], 2, 2)[:, 1], self.l.weight.t(), self.l.weight[2]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_views_of_inputs_and_parameters_share_their_storage(grad: bool) -> None:
    eager, om = twin(_InputViews(), fallback="raise")
    for b in (3, 5, 6):  # 5 captures the batch as a symbol: AOTAutograd cannot replay symbolic views itself
        x = torch.randn(b, 4, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            oe, oo = eager(x), om(x)
        _same(oe, oo, (x, eager.l.weight), (x, om.l.weight))
        if grad:
            for m, out in ((eager, oe), (om, oo)):
                (out[0].sum() + out[3].pow(2).sum() + out[5].sum()).backward()
            torch.testing.assert_close(om.l.weight.grad, eager.l.weight.grad)
            eager.zero_grad(set_to_none=True)
            om.zero_grad(set_to_none=True)
    with torch.no_grad():  # a write through a parameter's view reaches the parameter
        om(torch.randn(3, 4))[5].fill_(7.0)
    assert torch.equal(om.l.weight[2], torch.full((4,), 7.0))
    assert_ran_in_ort(om)


class _Pieces(nn.Module):
    """The pieces of a multi-output view (``split``) and the tensor they are cut from."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple:
        y = self.l(x).relu()
        a, b, c = y.split(2, dim=1)
        return y, a, c.t()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_pieces_of_a_split_share_its_storage(grad: bool) -> None:
    eager, om = twin(_Pieces(), fallback="raise")
    for b in (3, 5):
        x = torch.randn(b, 4)
        with torch.set_grad_enabled(grad):
            oe, oo = eager(x), om(x)
        _same(oe, oo, (x,), (x,))
        if grad:
            for out in (oe, oo):
                (out[1].pow(2).sum() + out[2].sum()).backward()
            for pe, po in zip(eager.parameters(), om.parameters()):
                torch.testing.assert_close(po.grad, pe.grad)


class _LoneView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).view(12)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_lone_view_stays_as_it_was(grad: bool) -> None:
    """A view no other output shares costs nothing: the graph is compiled as AOTAutograd gave it."""
    om = ortlab.ORTModule(_LoneView(), fallback="raise")
    with torch.set_grad_enabled(grad):
        om(torch.randn(3, 4))
    notes = [n for c in om.report.captures for g in c.graphs for n in g.notes]
    assert not any("Note [Outputs that alias]" in n for n in notes), notes


def test_a_base_laid_out_otherwise_gets_the_views_replayed() -> None:
    """Where a base's strides are not eager's (the one ``as_strided`` would read other elements), the view ops
    themselves are replayed on it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ortlab.pipeline.graph import _making_views, _output_views

    def f(x: torch.Tensor) -> tuple:
        y = x * 2
        return y, y[1], y.t()

    x = torch.randn(3, 4)
    views = _output_views(make_fx(f, tracing_mode="fake")(x))
    assert views is not None and views.strided is not None and views.positions == [1, 2]
    y = (x * 2).t().contiguous().t()  # eager's values, transposed in memory
    out = _making_views(lambda args: [y, y, y], views)([x])
    assert out[0] is y
    for got, want in zip(out[1:], (y[1], y.t())):
        assert torch.equal(got, want) and got.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
