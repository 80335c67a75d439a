"""Integers, reductions over nothing and refused inputs through ortlab, against eager PyTorch.

Integer ops compute exactly and wrap as PyTorch's (Note [Integer arithmetic stays integer] in
``ortlab.torchlib.integers``): through onnxruntime ``div(123456789, 10, rounding_mode="trunc")``
was 12345679, ``[2**53, 1].sum()`` was 2**53 and an overflowing ``cumprod`` saturated. Inputs PyTorch
refuses raise PyTorch's error (Note [Value guards] in ``ortlab.onnx.guards``, Note [Integers and
empty reductions in PyTorch] in ``ortlab.placement``): a division by zero, ``x.max()`` of an empty
tensor, a binary cross-entropy target of 2. Integers compare exactly, errors by class and message,
and each module keeps working after the error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab

B53, B62 = 2**53, 2**62
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


class Fn(nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> object:
        return self.fn(*xs)


def ort(fn: Callable, fallback: str = "raise") -> ortlab.ORTModule:
    """An ORTModule of ``fn``; ``fallback="raise"``: every op runs in onnxruntime."""
    return ortlab.ORTModule(Fn(fn), fallback=fallback)


def assert_same(actual: object, expected: object) -> None:
    """Same structure, dtypes and shapes; tensors equal exactly (NaN where eager's is)."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
        return
    assert isinstance(actual, torch.Tensor), actual
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (actual, expected)
    assert torch.equal(actual, expected) or (actual.is_floating_point() and torch.equal(actual.isnan(), expected.isnan())
                                             and torch.equal(actual.nan_to_num(), expected.nan_to_num())), (actual, expected)


def check(om: nn.Module, fn: Callable, *xs: torch.Tensor) -> None:
    assert_same(om(*[x.clone() for x in xs]), fn(*[x.clone() for x in xs]))


def assert_raises_as_eager(om: nn.Module, fn: Callable, *xs: torch.Tensor) -> None:
    """``om`` raises what ``fn`` raises on ``xs`` in eager: the same class, PyTorch's message."""
    with pytest.raises(Exception) as eager:
        fn(*[x.clone() for x in xs])
    with pytest.raises(type(eager.value)) as got:
        om(*[x.clone() for x in xs])
    assert type(got.value) is type(eager.value)
    assert str(eager.value) in str(got.value), (str(eager.value), str(got.value))


# ------------------------------------------------------------------------------------------- division
DIVISIONS = {
    "trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "floordiv": lambda a, b: a // b,
    "remainder": lambda a, b: a % b,
    "fmod": torch.fmod,
}
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dividends near the dtype's ends and 2**53, divisors of both signs."""
    info = torch.iinfo(dtype)
    if dtype == torch.uint8:
        return torch.tensor([255, 254, 7, 0, 200], dtype=dtype), torch.tensor([1, 3, 2, 5, 255], dtype=dtype)
    a = [info.max, info.min, info.min + 1, 123456789 % (info.max + 1), -7, 7, info.max - 1]
    b = [1, 2, -1, 10, 2, -2, 3]
    if dtype == torch.int64:
        a += [B53 + 1, -(B53 + 3), B62 + 5, 10**15 + 7]
        b += [1, 10, -7, 3]
    return torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)


def _all_divisions(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(fn(a, b) for fn in DIVISIONS.values())


def _flooring_divisions(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The divisions eager answers for the smallest integer over -1 (its truncating division is SIGFPE)."""
    return tuple(fn(a, b) for name, fn in DIVISIONS.items() if name != "trunc")


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_integer_division_is_exact(dtype):
    check(ort(_all_divisions), _all_divisions, *_operands(dtype))
    if dtype != torch.uint8:
        lowest = torch.iinfo(dtype).min
        check(ort(_flooring_divisions), _flooring_divisions, torch.tensor([lowest, lowest, 5], dtype=dtype),
              torch.tensor([-1, 1, -1], dtype=dtype))


def test_integer_division_by_python_numbers_is_exact():
    a = torch.tensor([B53 + 1, -(B53 + 3), B62 + 5, I64_MIN, 7])
    for fn in (lambda t: t // 7, lambda t: t % -3, lambda t: torch.div(t, 10, rounding_mode="trunc"),
               lambda t: torch.fmod(t, 7), lambda t: 7 % (t.abs() + 1), lambda t: t // -1):
        check(ort(fn), fn, a)


@pytest.mark.parametrize("name", list(DIVISIONS))
def test_division_by_zero_raises_pytorchs_error_and_the_module_keeps_working(name):
    fn = DIVISIONS[name]
    om = ort(fn)
    for dtype in (torch.int64, torch.uint8):
        a, b = torch.tensor([7, 2, 9], dtype=dtype), torch.tensor([2, 0, 1], dtype=dtype)
        assert_raises_as_eager(om, fn, a, b)
        with pytest.raises(RuntimeError, match="^ZeroDivisionError"):
            om(a, b)
        check(om, fn, a, torch.tensor([2, 3, 1], dtype=dtype))  # usable afterwards
    # nothing divided, nothing raised (as in eager)
    check(ort(fn), fn, torch.zeros(0, dtype=torch.int64), torch.tensor([0]))


def test_division_by_a_python_zero_raises_pytorchs_error():
    om = ort(lambda a: a // 0)
    with pytest.raises(RuntimeError, match="^ZeroDivisionError"):
        om(torch.tensor([1, 2]))


# ------------------------------------------------------------------------------------------- reductions and products
BIG = torch.tensor([B53 + 1, -(B53 + 3), B62 + 5, I64_MIN + 7, I64_MAX, 3, -5, 1])
INT32 = torch.tensor([2**31 - 1, -(2**31), 2**24 + 1, -(2**24) - 3, 5, -7, 3, 1], dtype=torch.int32)
REDUCTIONS = {
    "sum": lambda t: t.sum(),
    "sum_dim": lambda t: t.reshape(2, 4).sum(0),
    "sum_keepdim": lambda t: t.reshape(2, 2, 2).sum((0, 2), keepdim=True),
    "sum_dtype_int32": lambda t: t.sum(dtype=torch.int32),
    "sum_expanded": lambda t: t.unsqueeze(0).expand(3, 8).sum(0),
    "nansum": lambda t: t.nansum(),
    "prod": lambda t: t.prod(),
    "prod_dim": lambda t: t.reshape(2, 4).prod(1),
    "prod_odd": lambda t: t[:7].reshape(7, 1).prod(0, keepdim=True),
    "cumprod": lambda t: t.cumprod(0),
    "cumsum": lambda t: t.cumsum(0),
    "trace": lambda t: t.reshape(2, 4)[:, :2].trace(),
    "diagonal": lambda t: torch.diagonal(t.reshape(2, 2, 2), 1, 2, 0),
    "addbmm": lambda t: torch.addbmm(t[:4].reshape(2, 2), t.reshape(2, 2, 2), t.flip(0).reshape(2, 2, 2), alpha=3),
    "pow_scalar": lambda t: t ** 35,
    "square": lambda t: t * t,
    "mask_count": lambda t: (t > 0).sum() + (t < 0).sum(1 - 1),
}


# eager has no addbmm and diagonal kernels for the small dtypes; onnxruntime no int16 Where (cumprod's
# decomposition): that one runs in PyTorch (kind "kernel").
_NOT_SMALL = ("addbmm", "diagonal")
INTEGER_INPUTS = {
    "int64_edges": BIG, "int32_edges": INT32, "int64_powers": torch.tensor([3**20, 3**15, 2**40, 2**30, 3, 7, 1, 5]),
    "int64_2**53+1": torch.full((8,), B53 + 1), "uint8": torch.tensor([255, 255, 2, 3, 0, 1, 7, 9], dtype=torch.uint8),
    "int16": torch.tensor([32767, -32768, 300, 3, -1, 2, 7, 9], dtype=torch.int16),
}


@pytest.mark.parametrize("name", list(INTEGER_INPUTS))
def test_integer_reductions_and_products_are_exact(name):
    t = INTEGER_INPUTS[name]
    ops = {k: f for k, f in REDUCTIONS.items() if t.dtype in (torch.int64, torch.int32) or k not in _NOT_SMALL}

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(f(t) for f in ops.values())

    om = ort(fn, fallback="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = om(t.clone())
    for op, got, expected in zip(ops, out, fn(t.clone())):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape) and torch.equal(got, expected), \
            (op, got, expected)
    assert not [f for f in om.report.fallbacks if f.kind != "kernel"], om.report.fallbacks


def test_integer_powers_of_tensors_run_in_pytorch_exactly():
    for fn, args in [(lambda t: 3 ** t, (torch.tensor([35, 40, 2]),)),
                     (lambda t, e: t ** e, (torch.tensor([3, 3, 7]), torch.tensor([35, 40, 2])))]:
        om = ort(fn, fallback="warn")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check(om, fn, *args)
        assert any(f.kind == "known_wrong" and f.op == "aten.pow" for f in om.report.fallbacks)


def test_integer_sums_beside_float_training_match_eager():
    """A loss normalized by an integer count (masked mean): forward and gradients as eager's."""
    lin_e = nn.Linear(4, 1)
    lin_o = ortlab.ORTModule(Fn(lambda x, mask: (lin_e(x).squeeze(1) * mask).sum() / mask.sum()), fallback="raise")
    x, mask = torch.randn(6, 4), torch.tensor([1, 0, 1, 1, 0, 1])
    eager = (lin_e(x).squeeze(1) * mask).sum() / mask.sum()
    grads_e = torch.autograd.grad(eager, list(lin_e.parameters()))
    out = lin_o(x, mask)
    grads_o = torch.autograd.grad(out, list(lin_e.parameters()))
    torch.testing.assert_close(out, eager)
    for g_o, g_e in zip(grads_o, grads_e):
        torch.testing.assert_close(g_o, g_e)


def test_python_numbers_the_integer_dtype_cannot_hold_raise_pytorchs_error():
    t = torch.tensor([1, -2], dtype=torch.int32)
    for fn in (lambda t: t.masked_fill(t > 0, 2**31), lambda t: torch.full_like(t, B53 + 1),
               lambda t: t.clamp(max=2**40), lambda t: t.to(torch.int8).masked_fill(t > 0, 300)):
        om = ort(fn, fallback="warn")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_raises_as_eager(om, fn, t)
    fn = lambda t: torch.full_like(t, 2**31 - 1) + t.masked_fill(t > 0, -1)  # noqa: E731  (they fit: onnxruntime)
    check(ort(fn), fn, t)


# ------------------------------------------------------------------------------------------- reductions over nothing
E, E3 = torch.randn(0, 4), torch.randn(3, 0)
NOTHING = [
    ("max", lambda x: x.max(), E), ("min", lambda x: x.min(), E3), ("max_int", lambda x: x.long().max(), E),
    ("max_dim", lambda x: x.max(0).values, E), ("min_dim", lambda x: x.min(1), E3),
    ("max_dim_indices", lambda x: x.max(1), E3), ("amax", lambda x: x.amax(0), E), ("amin_all", lambda x: x.amin(), E),
    ("argmax", lambda x: x.argmax(), E),
    ("aminmax", lambda x: torch.aminmax(x, dim=0), E), ("median", lambda x: x.median(0), E),
    ("mode", lambda x: x.mode(1), E3), ("kthvalue", lambda x: x.kthvalue(1, 0), E),
]


@pytest.mark.parametrize("name, fn, empty", NOTHING, ids=[n for n, _, _ in NOTHING])
def test_reductions_over_nothing_raise_pytorchs_error_and_the_module_keeps_working(name, fn, empty):
    om = ort(fn, fallback="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_raises_as_eager(om, fn, empty)
        check(om, fn, torch.randn(3, 4))
        assert_raises_as_eager(om, fn, empty)


EMPTY_RESULTS = [
    ("mse", lambda x: F.mse_loss(x, torch.zeros_like(x))), ("l1", lambda x: F.l1_loss(x, torch.zeros_like(x))),
    ("smooth_l1", lambda x: F.smooth_l1_loss(x, torch.zeros_like(x))),
    ("huber", lambda x: F.huber_loss(x, torch.zeros_like(x))),
    ("bce", lambda x: F.binary_cross_entropy(x.sigmoid(), torch.zeros_like(x))),
    ("bce_logits", lambda x: F.binary_cross_entropy_with_logits(x, torch.zeros_like(x))),
    ("cross_entropy", lambda x: F.cross_entropy(x, torch.zeros(0, dtype=torch.long))),
    ("mean_std_var", lambda x: torch.stack([x.mean(), x.std(), x.var(0).sum(), x.norm(), x.logsumexp(0).sum()])),
    ("any_all", lambda x: torch.stack([x.any(), x.all(), x.bool().any(0).any(), (x > 0).any()])),
    ("max_over_present_dim", lambda x: x.max(1)),
]


@pytest.mark.parametrize("name, fn", EMPTY_RESULTS, ids=[n for n, _ in EMPTY_RESULTS])
def test_reductions_of_an_empty_batch_match_eager_forward_and_backward(name, fn):
    x_e, x_o = torch.randn(0, 4, requires_grad=True), torch.randn(0, 4, requires_grad=True)
    out_e, out_o = fn(x_e), ort(fn)(x_o)
    assert_same(out_o, out_e)
    leaves = [o for o in (out_e if isinstance(out_e, tuple) else (out_e,)) if o.is_floating_point()]
    if leaves and leaves[0].requires_grad:
        leaves[0].sum().backward()
        o_leaf = out_o[0] if isinstance(out_o, tuple) else out_o
        o_leaf.sum().backward()
        assert_same(x_o.grad, x_e.grad)


# ------------------------------------------------------------------------------------------- refused inputs
def _bce(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy(p, t)


BCE_REFUSED = [  # one length: one capture
    ("target_2", [0.3, 0.6, 0.5], [0.0, 1.0, 2.0]),
    ("input_1.5", [1.5, 0.5, 0.5], [0.0, 1.0, 1.0]),
    ("input_nan", [float("nan"), 0.5, 0.5], [0.0, 1.0, 1.0]),
    ("target_nan", [0.2, 0.5, 0.5], [float("nan"), 1.0, 1.0]),
    ("target_negative", [-0.0, 0.5, 0.5], [-0.1, 1.0, 1.0]),
    ("target_first", [0.5, 1.5, 0.5], [2.0, 1.0, 1.0]),  # the first failing element decides the message
    ("input_first", [1.5, 0.5, 0.5], [1.0, 2.0, 1.0]),
]


def test_binary_cross_entropy_refuses_what_pytorch_refuses_and_keeps_training():
    lin = nn.Linear(3, 1)
    eager_lin = nn.Linear(3, 1)
    eager_lin.load_state_dict(lin.state_dict())

    def loss(p: torch.Tensor, t: torch.Tensor, layer: nn.Module = lin) -> torch.Tensor:
        return _bce(p, t) + _bce(layer(p.view(-1, 1).expand(-1, 3)).sigmoid().squeeze(1), t.clamp(0, 1))

    om = ortlab.ORTModule(Fn(loss), fallback="raise")
    for _, p, t in BCE_REFUSED:
        p, t = torch.tensor(p, requires_grad=True), torch.tensor(t)
        assert_raises_as_eager(om, _bce, p, t)
    # valid inputs: forward and gradients as eager, after the errors
    p_e, p_o = torch.tensor([0.3, 0.6, 0.5], requires_grad=True), torch.tensor([0.3, 0.6, 0.5], requires_grad=True)
    t = torch.tensor([0.0, 1.0, 0.25])
    out_e = loss(p_e, t, eager_lin)
    out_o = om(p_o, t)
    torch.testing.assert_close(out_o, out_e)
    out_e.backward()
    out_o.backward()
    torch.testing.assert_close(p_o.grad, p_e.grad)
    for a, b in zip(lin.parameters(), eager_lin.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_argmax_of_bool_raises_pytorchs_error(op):
    fn = (lambda t: t.argmax()) if op == "argmax" else (lambda t: t.argmin(0))
    om = ort(fn, fallback="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_raises_as_eager(om, fn, torch.tensor([True, True, False]))
        check(om, fn, torch.tensor([3, 9, 1]))


def test_a_models_own_assert_is_a_guard_in_onnxruntime():
    """``torch._assert_async`` in a model raises its message through onnxruntime, forward and backward graphs."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        torch._assert_async((x > 0).all(), "x must be positive")
        return (x * 2).sum()

    om = ort(fn)
    with pytest.raises(RuntimeError, match="^x must be positive"):
        om(torch.tensor([1.0, -1.0], requires_grad=True))
    x = torch.tensor([1.0, 3.0], requires_grad=True)
    om(x).backward()
    assert_same(x.grad, torch.tensor([2.0, 2.0]))
