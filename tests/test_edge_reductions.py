"""Reductions' and masks' gradients with eager's signs of zero, and scatters of an empty index.

onnxruntime's CPU ``Where`` writes a -0.0 selected from its first branch as +0.0 (Note [A -0.0 from Where's
first branch] in ortlab.runtime.cpu_rewrites): every gradient masked by a select (``clamp``, ``hardtanh``,
``nll_loss``, ``max()``'s even split) lost an incoming -0.0. ``leaky_relu``'s and ``prelu``'s gradients select
between two tensors (Note [A slope's gradient as a product] in ortlab.capture.float_edges). An empty index of
any dtype scatters nothing (Note [Scatters of a 0-dim tensor] in ortlab.capture.decompositions); ``scatter`` with
``reduce=`` runs in onnxruntime, and ``index_add`` of a source of another shape raises eager's error.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

import ortlab
from ortlab.runtime.cpu_rewrites import MIN_SELECT_ELEMENTS, checked_selects, exact_selects

F = nn.functional
TARGET = torch.tensor([0, 1, 2, 1])  # row 2: a +0.0 gradient at a kept target, -0.0 in eager
GRADIENTS = {
    "clamp_min": lambda x: x.clamp_min(0.5),
    "clamp": lambda x: x.clamp(-0.5, 0.5),
    "relu6": F.relu6,
    "hardsigmoid": F.hardsigmoid,
    "max()": lambda x: x.max(),
    "median()": lambda x: x.median(),
    "cross_entropy, ignore_index": lambda x: F.cross_entropy(x, TARGET, ignore_index=1, reduction="none"),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "prelu": lambda x: F.prelu(x, torch.tensor([0.25], dtype=x.dtype)),
}


class _Op(nn.Module):
    def __init__(self, fn) -> None:  # noqa: ANN001
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Equal bits: the same values, NaNs and signs of zero."""
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Close (an ulp apart at most: softmax's exp, hardsigmoid's division), and each zero with eager's sign."""
    torch.testing.assert_close(got, expected, equal_nan=True)
    zeros = expected == 0
    assert torch.equal(torch.signbit(got[zeros]), torch.signbit(expected[zeros])), (got, expected)


def _grads(fn, x: torch.Tensor, cotangent) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    got = []
    for module in (_Op(fn), ortlab.ORTModule(_Op(fn))):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        (grad,) = torch.autograd.grad(out, leaf, cotangent(out))
        got.append((out.detach(), grad))
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(GRADIENTS))
def test_an_incoming_negative_zero_gradient_keeps_its_sign(name, dtype):
    x = torch.tensor([[-1.0, 0.5, -0.0, 0.0], [2.0, 2.0, -0.5, 0.25], [-3.0, 0.0, 1.0, -0.5], [0.5, 0.5, -2.0, 0.1]],
                     dtype=dtype)

    def cotangent(out: torch.Tensor) -> torch.Tensor:  # -0.0, +0.0 and negatives
        values = torch.tensor([-0.0, -1.5, 0.0, 2.0, -0.0, -0.25], dtype=dtype)
        return values.repeat(out.numel() // 6 + 1)[: out.numel()].reshape(out.shape)

    (out_e, grad_e), (out_o, grad_o) = _grads(GRADIENTS[name], x, cotangent)
    _assert_same(out_o, out_e)
    _assert_same(grad_o, grad_e)


def test_a_large_masked_gradient_with_nan_keeps_negative_zeros():
    """A checked multiply's If falls back to the Where at a NaN: that Where is swapped too."""
    x = torch.linspace(-2, 2, MIN_SELECT_ELEMENTS * 2).reshape(256, -1)

    def cotangent(out: torch.Tensor) -> torch.Tensor:
        c = torch.full_like(out, -0.0)
        c[::2] = -1.0
        c[0, 0] = float("nan")
        return c

    (_, grad_e), (_, grad_o) = _grads(lambda t: t.clamp(-1.0, 1.0), x, cotangent)
    assert torch.equal(_bits(grad_o), _bits(grad_e))


def test_a_forward_where_keeps_a_negative_zero():
    x = torch.tensor([-0.0, 1.0, -0.0, -2.0])
    fn = lambda t: torch.where(t < 0.5, t, 0.0) * 1  # noqa: E731
    got, expected = ortlab.ORTModule(_Op(fn))(x), _Op(fn)(x)
    assert torch.equal(_bits(got), _bits(expected)), (got, expected)


# ------------------------------------------------------------------------------- the pass on bare graphs
def _where_model(first: str, second: str, n: int, negated: bool = False) -> ir.Model:
    """``Where(c, first, second)`` of a bool ``c`` and a float ``x`` (``first``/``second``: "x", or a number)."""
    c = ir.Value(name="c", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([n]))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([n]))
    nodes: list[ir.Node] = []
    cond = c
    if negated:
        nodes.append(ir.node("Not", [c]))
        cond = nodes[-1].outputs[0]

    def operand(what: str) -> ir.Value:
        if what == "x":
            return x
        nodes.append(ir.node("Constant", [], {"value": ir.tensor(np.array(float(what), dtype=np.float32))}))
        return nodes[-1].outputs[0]

    where = ir.node("Where", [cond, operand(first), operand(second)])
    nodes.append(where)
    out = where.outputs[0]
    out.name, out.dtype, out.shape = "out", ir.DataType.FLOAT, ir.Shape([n])
    graph = ir.Graph([c, x], [out], nodes=nodes, opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, c: np.ndarray, x: np.ndarray, level: ort.GraphOptimizationLevel) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"c": c, "x": x})[0]


@pytest.mark.parametrize("form", ["Where(c, x, 0)", "Where(Not(c), x, 0)", "Where(c, x, 1.5)", "Where(c, 0, x)",
                                  "Where(c, x, -0.0)"])
def test_where_is_exact_after_the_pass(form):
    n = 12
    negated = form.startswith("Where(Not")
    first, second = form.split(", ", 1)[1].rstrip(")").split(", ")
    model = _where_model(first, second, n, negated)
    swapped = exact_selects(model)
    assert swapped == (1 if form in ("Where(c, x, 0)", "Where(Not(c), x, 0)", "Where(c, x, 1.5)") else 0)
    ops = [node.op_type for node in model.graph]
    assert "Not" not in ops  # a Not is dropped, or never was; NotWhereFusion would swap the branches back
    c = np.arange(n) % 3 == 0
    x = np.array([-0.0, 0.0, -1.0] * (n // 3), dtype=np.float32)
    cond = ~c if negated else c

    def value(what: str) -> np.ndarray:
        return x if what == "x" else np.full(n, float(what), dtype=np.float32)

    expected = np.where(cond, value(first), value(second))
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        got = _run(model, c, x, level)
        if form != "Where(c, x, -0.0)":  # left as it was: both branches may hold -0.0
            assert np.array_equal(got.view(np.int32), expected.view(np.int32)), (form, got, expected)


def test_a_where_of_two_scalars_stays_a_where():
    """onnxruntime selects between two one-element operands faster than the checked multiply."""
    model = _where_model("1.0", "0.25", MIN_SELECT_ELEMENTS)
    assert checked_selects(model) == 0
    assert [node.op_type for node in model.graph][-1] == "Where"
    assert checked_selects(_where_model("x", "0.25", MIN_SELECT_ELEMENTS)) == 1


# ------------------------------------------------------------------------------- empty indices
def test_an_empty_uint8_index_gathers_and_scatters_in_onnxruntime():
    """PyTorch checks an index's dtype only when it has elements; ScatterElements takes int32/int64 indices."""
    index = torch.zeros(3, 0, dtype=torch.uint8)

    class Gather(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.gather(x, 1, index).sum() + torch.scatter_add(x, 1, index, x[:, :0]) * 2

    results = []
    for module in (Gather(), ortlab.ORTModule(Gather())):
        torch.manual_seed(0)
        x = torch.randn(3, 4).requires_grad_()
        out = module(x)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    (out_e, grad_e), (out_o, grad_o) = results
    assert torch.equal(out_o, out_e) and torch.equal(grad_o, grad_e)
    assert not module.report.fallbacks, module.report.fallbacks


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_scatter_with_reduce_runs_in_onnxruntime(dtype):
    """``scatter(..., reduce=)`` (deprecated) had no translation: it ran in PyTorch."""
    index = torch.tensor([[0, 1, 0], [1, 1, 0]])

    class Scatter(nn.Module):
        def forward(self, x: torch.Tensor, src: torch.Tensor) -> list[torch.Tensor]:
            return [x.scatter(0, index, src, reduce="add"), x.scatter(0, index, src, reduce="multiply"),
                    x.scatter(0, index, -2.5, reduce="add"), x.scatter(0, index, 3, reduce="multiply")]

    x, src = torch.arange(-3, 6, dtype=dtype).reshape(3, 3), torch.arange(1, 7, dtype=dtype).reshape(2, 3)
    module = ortlab.ORTModule(Scatter())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The reduce argument of torch.scatter ... is deprecated", once a process
        expected = Scatter()(x, src)
    for got, want in zip(module(x, src), expected):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    assert not module.report.fallbacks, module.report.fallbacks


@pytest.mark.parametrize("source", [[2], [2, 2, 1], "0-dim self, [1]"])
def test_index_add_of_a_source_of_another_shape_raises_as_in_eager(source):
    """torch's decomposition leaves out PyTorch's last check: onnxruntime raised its own error, or the op ran."""
    zero_dim = isinstance(source, str)
    shape = [1] if zero_dim else source

    class IndexAdd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            target = x[0, 0] if zero_dim else x
            return target.index_add(0, torch.tensor([0] if zero_dim else [0, 1]), torch.ones(shape))

    message = "source tensor shape must match self tensor shape, excluding the specified dimension"
    for module in (IndexAdd(), ortlab.ORTModule(IndexAdd())):
        with pytest.raises(RuntimeError, match=message):
            module(torch.randn(3, 2))


class _MarginLoss(nn.Module):
    def __init__(self, fn) -> None:  # noqa: ANN001
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.fn(x, t)


MARGIN_LOSSES = {
    "multi_margin p=1": lambda x, t: F.multi_margin_loss(x, t[:, 0], reduction="none"),
    "multi_margin p=2, mean": lambda x, t: F.multi_margin_loss(x, t[:, 0], p=2, margin=0.5),
    "multi_margin weighted, sum": lambda x, t: F.multi_margin_loss(x, t[:, 0], weight=torch.arange(1.0, 6.0),
                                                                   reduction="sum"),
    "multi_margin of a 0-dim input": lambda x, t: F.multi_margin_loss(x[0, 0], t[0, 0].clamp(max=0),
                                                                      reduction="none"),
    "multilabel_margin": lambda x, t: F.multilabel_margin_loss(x, t, reduction="none"),
    "multilabel_margin, mean": lambda x, t: F.multilabel_margin_loss(x, t),
}


@pytest.mark.parametrize("name", list(MARGIN_LOSSES))
def test_margin_losses_have_eager_s_shapes_and_gradient_zeros(name):
    """PyTorch's kernels multiply the incoming gradient in last: a zero of the input's gradient has its sign
    (-0.0 under a negative one), and a 0-dim input's loss is 0-dim."""
    x = torch.tensor([[3.0, -1.0, 0.5, 0.25, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0], [5.0, -5.0, 1.0, 0.5, 0.2]])
    t = torch.tensor([[0, 2, -1, 1, 1], [1, -1, 0, 0, 0], [4, 0, 3, -1, 2]])
    results = []
    for module in (_MarginLoss(MARGIN_LOSSES[name]), ortlab.ORTModule(_MarginLoss(MARGIN_LOSSES[name]))):
        a = x.clone().requires_grad_()
        out = module(a, t)
        out.backward(torch.full_like(out, -0.75))
        results.append((out.detach(), a.grad))
    (eo, eg), (oo, og) = results
    assert oo.shape == eo.shape, (oo.shape, eo.shape)
    torch.testing.assert_close(oo, eo)
    torch.testing.assert_close(og, eg)
    assert torch.equal(torch.signbit(og), torch.signbit(eg)), (og, eg)


class _Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1)


def test_softmax_s_gradient_at_an_underflowed_probability_keeps_eager_s_zero():
    """Eager's ``y * (g - sum(g * y))`` is -0.0 where y underflowed and g - s < 0; torch's decomposition
    ``g * y - y * s`` gave +0.0."""
    x = torch.tensor([[0.0, -200.0, 1.0, -300.0], [5.0, -1000.0, 5.0, 0.0]])
    g = torch.tensor([[1.0, 0.5, 2.0, -1.0], [0.5, 0.25, 1.0, 4.0]])  # 0 < g < sum(g * y) where y is 0
    results = []
    for module in (_Softmax(), ortlab.ORTModule(_Softmax())):
        a = x.clone().requires_grad_()
        module(a).backward(g)
        results.append(a.grad)
    torch.testing.assert_close(results[1], results[0])
    assert torch.equal(torch.signbit(results[1]), torch.signbit(results[0])), results


SUMS = {
    "sum(1)": lambda x: x.sum(1),
    "sum()": lambda x: x.sum(),
    "mean(1)": lambda x: x.mean(1),
    "mean()": lambda x: x.mean(),
    "sum(1, keepdim)": lambda x: x.sum(1, keepdim=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(SUMS))
def test_a_sum_of_negative_zeros_is_positive_zero(name, dtype):
    """PyTorch's sum starts from +0.0; onnxruntime's ReduceSum over inner axes from the first term (-0.0)."""
    x = torch.full((5, 2), -0.0, dtype=dtype)
    got, expected = ortlab.ORTModule(_Op(SUMS[name]))(x), SUMS[name](x)
    assert torch.equal(_bits(got), _bits(expected)), (got, expected)


class _Ranking(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.margin_ranking_loss(a, b, t, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_broadcast_input_s_gradient_of_masked_terms_is_eager_s_zero(dtype):
    """The gradient of a broadcast input sums (sum_to_size) terms a hinge masked, -0.0 each: eager's +0.0."""
    a = torch.tensor([[-4.8, -7.6], [-0.6, -1.5], [-2.0, -4.1]], dtype=dtype)
    b = torch.tensor([[5.6], [-8.3], [4.2]], dtype=dtype)
    t = torch.tensor([[-3.1, -3.3]], dtype=dtype)
    grads = []
    for module in (_Ranking(), ortlab.ORTModule(_Ranking())):
        leaves = [v.clone().requires_grad_() for v in (a, b, t)]
        module(*leaves).backward(torch.tensor([[1.0, -0.5], [0.25, 2.0], [-1.0, 1.5]], dtype=dtype))
        grads.append(leaves[1].grad)
    assert torch.equal(_bits(grads[1]), _bits(grads[0])), grads


PRODS = {
    "prod(), two zeros": (lambda x: x.prod(), [2.0, 3.0, 0.0, 0.0]),
    "prod(), one zero": (lambda x: x.prod(), [2.0, -3.0, 0.0, 0.5]),
    "prod(), no zero, underflow": (lambda x: x.prod(), [1e-30, -1e-30, 1e-30, 4.0]),
    "prod(0), a zero": (lambda x: torch.prod(x.reshape(2, 2), 0), [2.0, -3.0, 0.0, 0.5]),
    "prod(1, keepdim), no zero": (lambda x: x.reshape(2, 2).prod(1, keepdim=True), [2.0, -3.0, 1e-30, -1e-30]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(PRODS))
def test_prod_s_gradient_takes_eager_s_formula(name, dtype):
    """Eager's prod backward picks its formula by the data (Note [prod's gradient as eager's])."""
    fn, values = PRODS[name]
    x = torch.tensor(values, dtype=dtype)
    (out_e, grad_e), (out_o, grad_o) = _grads(fn, x, lambda out: torch.full_like(out, -1.5))
    assert torch.equal(_bits(out_o), _bits(out_e))
    torch.testing.assert_close(grad_o, grad_e, equal_nan=True)
    assert torch.equal(torch.signbit(grad_o), torch.signbit(grad_e)), (grad_o, grad_e)


def test_prod_over_the_dim_of_a_0_dim_tensor_runs_in_onnxruntime():
    om = ortlab.ORTModule(_Op(lambda x: torch.prod(x, 0) * 2))
    x = torch.tensor(-3.0, requires_grad=True)
    om(x).backward()
    assert x.grad.item() == 2.0 and not om.report.fallbacks, om.report
