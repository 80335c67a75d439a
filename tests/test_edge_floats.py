"""NaN, infinities, signed zeros, clip boundaries and overflow as eager PyTorch has them, forward and backward.

The reliability issue's float defects (ortlab/capture/float_edges.py, ortlab/torchlib/float_edges.py,
the attention decompositions in ortlab/capture/decompositions.py): each test runs one module of many ops
on edge values in eager PyTorch and through ORTModule, and compares every output (NaN and infinities in
place, the sign of every zero) and every input gradient (NaN and infinities in place). Each op reads its
own row of the input, so one op's NaN gradient cannot hide another's.

Rows are 64 long and the edge values sit in their first half: PyTorch's activation kernels treat a NaN
on their vector path (every element here) and on their scalar tail differently, and the vector path is
what a real tensor's elements take.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab

NAN, INF = math.nan, math.inf
DTYPES = [torch.float32, torch.float64]
Op = Callable[[torch.Tensor], torch.Tensor]


class Rows(nn.Module):
    """``ops[i]`` applied to row ``i`` of its input; returns each op's output."""

    def __init__(self, ops: dict[str, Op]) -> None:
        super().__init__()
        self.ops = list(ops.values())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(op(x[i]) for i, op in enumerate(self.ops))


def _row(values: list[float]) -> list[float]:
    """``values`` then ordinary numbers, 64 in all."""
    return [*values, *(0.37 * i - 5.1 for i in range(64 - len(values)))]


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    return (2e-5, 1e-6) if dtype == torch.float32 else (1e-9, 1e-12)


def _assert_same(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
                 signed_zeros: bool) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (name, actual, expected)
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), (name, actual, expected)
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{name}: {m}")
    if signed_zeros:
        zeros = expected == 0
        assert torch.equal(actual[zeros].signbit(), expected[zeros].signbit()), (
            f"{name}: signs of zeros differ: eager {expected.tolist()}, ortlab {actual.tolist()}")


def _ran_in_onnxruntime(om: ortlab.ORTModule) -> None:
    """No graph ran in PyTorch whole (single ops may: signbit, float64 ops with inexact constants)."""
    whole = [str(f) for f in om.report.fallbacks if f.scope != "op"]
    assert not whole, whole


def _compare(ops: dict[str, Op], x: torch.Tensor, *, grad: bool = True, weights: torch.Tensor | None = None,
             rtol: float | None = None, atol: float | None = None, grad_rtol: dict[str, float] | None = None) -> None:
    """Eager against ORTModule on ``x`` (row i for op i): outputs with signed zeros, input gradients."""
    default_rtol, default_atol = _tolerances(x.dtype)
    rtol = default_rtol if rtol is None else rtol
    om = ortlab.ORTModule(Rows(ops))
    results = []
    for module in (Rows(ops), om):
        inp = x.clone().requires_grad_(grad)
        outs = module(inp)
        if grad:
            loss = sum((o * (weights if weights is not None and o.shape == weights.shape else 1)).sum()
                       for o in outs if o.requires_grad)
            loss.backward()
        results.append(([o.detach() for o in outs], inp.grad))
    _ran_in_onnxruntime(om)
    (ours, our_grad), (eager, eager_grad) = results[1], results[0]
    for name, a, e in zip(ops, ours, eager, strict=True):
        # denormals aside (an ulp of 1e-45 is 4% of 3.7e-44)
        _assert_same(name, a, e, rtol, torch.finfo(x.dtype).tiny if atol is None else atol, signed_zeros=True)
    if grad:
        for i, name in enumerate(ops):
            _assert_same(f"{name} gradient", our_grad[i], eager_grad[i], (grad_rtol or {}).get(name, rtol),
                         default_atol, signed_zeros=False)


# --------------------------------------------------------------------------- clip and activation boundaries
BOUNDARY_VALUES = [-7., -6., -3., -1., -0.5, -0., 0., 0.5, 1., 3., 6., 7., 20., NAN, INF, -INF]
BOUNDARY_OPS: dict[str, Op] = {
    "relu": F.relu,
    "relu6": F.relu6,
    "hardtanh": F.hardtanh,
    "hardtanh(0, 6)": lambda x: F.hardtanh(x, 0.0, 6.0),
    "hardtanh(-0.3, 0.7)": lambda x: F.hardtanh(x, -0.3, 0.7),
    "clamp(-1, 6)": lambda x: x.clamp(-1, 6),
    "clamp(min=0.5)": lambda x: x.clamp(min=0.5),
    "clamp_min(0)": lambda x: torch.clamp_min(x, 0.0),
    "clamp(max=3)": lambda x: x.clamp(max=3),
    "threshold": lambda x: F.threshold(x, 1.0, -2.0),
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "elu": F.elu,
    "celu": lambda x: F.celu(x, 1.0),
    "selu": F.selu,
    "softplus": F.softplus,
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_at_clip_and_activation_boundaries_match_eager(dtype):
    """Defect 4: relu6's gradient at exactly 6 was the incoming gradient in float32 (torchlib's strict masks)."""
    rows = [_row(BOUNDARY_VALUES) for _ in BOUNDARY_OPS]
    x = torch.tensor(rows, dtype=dtype)
    _compare(BOUNDARY_OPS, x, weights=torch.arange(1.0, 65.0, dtype=dtype))


def test_relu6_gradient_at_six_is_zero():
    """The issue's repro: dL/dw at x = 6 is 0, as eager's."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu6(x * self.w)

    om = ortlab.ORTModule(M())
    om(torch.tensor([-1.0, 0.0, 1.0, 6.0, 0.5, 7.0])).sum().backward()
    assert om.w.grad.tolist() == [0.0, 0.0, 1.0, 0.0, 0.5, 0.0]


# ------------------------------------------------------------------------------------ NaN and signed zeros
SIGN_VALUES = [-2.5, -1.5, -0.7, -0.5, -0.3, -0., 0., 0.3, 0.5, 1.5, 2.5, NAN, -NAN, INF, -INF, 1e-40]
SIGN_OPS: dict[str, Op] = {
    "sign": torch.sign,
    "sgn": torch.sgn,
    "abs": torch.abs,
    "neg": torch.neg,
    "trunc": torch.trunc,
    "frac": torch.frac,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "round": torch.round,
    "remainder(x, 1)": lambda x: torch.remainder(x, 1.0),
    "remainder(x, -1)": lambda x: torch.remainder(x, -1.0),
    "fmod": lambda x: torch.fmod(x, 1.0),
    "div trunc": lambda x: torch.div(x, 0.7, rounding_mode="trunc"),
    "div floor": lambda x: torch.div(x, 0.7, rounding_mode="floor"),
    "atan2(x, -1)": lambda x: torch.atan2(x, -torch.ones_like(x)),
    "atan2(1, x)": lambda x: torch.atan2(torch.ones_like(x), x),
    "atan2(x, x.flip)": lambda x: torch.atan2(x, x.flip(0)),
    "clamp(0, 1)": lambda x: x.clamp(0, 1),
    "maximum(x, 0)": lambda x: torch.maximum(x, torch.zeros_like(x)),
    "minimum(x, 0)": lambda x: torch.minimum(x, torch.zeros_like(x)),
    "l1_loss": lambda x: F.l1_loss(x, torch.zeros_like(x), reduction="none"),
    "pow(x, 0.5)": lambda x: x.pow(0.5),
}
# no derivative in PyTorch: compared on a detached input
SIGN_OPS_NO_GRAD: dict[str, Op] = {
    "signbit": torch.signbit,
    "copysign(2, x)": lambda x: torch.copysign(torch.full_like(x, 2.0), x),
    "copysign(x, -0.)": lambda x: torch.copysign(x, torch.full_like(x, -0.0)),
    "heaviside(x, 0.5)": lambda x: torch.heaviside(x, torch.full_like(x, 0.5)),
    "floor_divide": lambda x: torch.floor_divide(x, 0.7),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_signed_zeros_match_eager(dtype):
    """Defects 8 and 9: sign(nan), signbit(-0.), trunc(-0.5), atan2(+0, -1), atan2(x, nan), remainder(-0., 1)."""
    ops = {**SIGN_OPS, **{k: (lambda f: lambda x: f(x.detach()))(f) for k, f in SIGN_OPS_NO_GRAD.items()}}
    x = torch.tensor([_row(SIGN_VALUES) for _ in ops], dtype=dtype)
    _compare(ops, x, weights=torch.arange(1.0, 65.0, dtype=dtype))


NAN_ROWS = [[1.0, NAN, 3.0, 0.5], [1.0, 2.0, 3.0, 4.0], [-0.0, 0.0, -1.0, 2.0], [INF, NAN, -INF, 1.0],
            [INF, 1.0, 2.0, 3.0], [-INF, -INF, -INF, -INF], [-INF, 1.0, 2.0, INF], [-0.0, -0.0, -0.0, -0.0]]
REDUCTIONS: dict[str, Op] = {
    "norm(inf)": lambda x: x.norm(p=INF, dim=1),
    "norm(-inf)": lambda x: torch.linalg.vector_norm(x, -INF, dim=1),
    "norm(1)": lambda x: x.norm(p=1, dim=1),
    "amax": lambda x: x.amax(1),
    "max": lambda x: x.max(1).values,
    "log_softmax": lambda x: F.log_softmax(x, 1),
    "softmax": lambda x: F.softmax(x, 1),
    "logsumexp": lambda x: x.logsumexp(1),
    "logcumsumexp": lambda x: x.logcumsumexp(1),
    "logcumsumexp(0)": lambda x: x.logcumsumexp(0),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.tensor([0, 2, 1, 3, 0, 1, 2, 3]), reduction="sum"),
}


class Reductions(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(op(x[i]) for i, op in enumerate(REDUCTIONS.values()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_keep_nan_and_infinities_like_eager(dtype):
    """Defect 9: norm(p=inf) dropped NaN; float64 log_softmax/cross_entropy of a NaN row were finite."""
    x = torch.tensor([NAN_ROWS] * len(REDUCTIONS), dtype=dtype)
    _compare(REDUCTIONS, x)


# -------------------------------------------------------------------------------------------- stable formulas
STABLE_VALUES = [-1e4, -200., -100., -30., -20., -17., -5., -1e-7, -0., 0., 1e-30, 1e-7, 0.5, 5., 20., 30.,
                 89., 100., 1e4, INF, -INF, NAN]
STABLE_OPS: dict[str, Op] = {
    "logaddexp(x, -2.5)": lambda x: torch.logaddexp(x, torch.full_like(x, -2.5)),
    "logaddexp(x, x)": lambda x: torch.logaddexp(x, x),
    "logaddexp2(x, 1)": lambda x: torch.logaddexp2(x, torch.ones_like(x)),
    "log_ndtr": torch.special.log_ndtr,
    "erfcx": torch.special.erfcx,
    "erfc": torch.erfc,
    "log1p": torch.log1p,
    "expm1": torch.expm1,
    "sigmoid": torch.sigmoid,
    "logsigmoid": F.logsigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "softplus(beta=50, threshold=1000)": lambda x: F.softplus(x, 50.0, 1000.0),
    "bce_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, torch.full_like(x, 0.3), reduction="none"),
    "xlogy(0, x)": lambda x: torch.xlogy(torch.zeros_like(x), x),
    "xlogy(x, x)": lambda x: torch.xlogy(x, x),
    "xlog1py(0, x)": lambda x: torch.special.xlog1py(torch.zeros_like(x), x),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_stable_formulas_match_eager_on_finite_extremes(dtype):
    """Defect 7: logaddexp(89, -2.5) was inf, log_ndtr(-20) and erfcx(100) NaN, log1p(1e-7) 19% off."""
    ops = STABLE_OPS
    x = torch.tensor([_row(STABLE_VALUES) for _ in ops], dtype=dtype)
    # erfcx's derivative, 2 x erfcx(x) - 2 / sqrt(pi), cancels: an ulp of erfcx is 1e-4 of it at x = 20
    _compare(ops, x, grad_rtol={"erfcx": 1e-3 if dtype == torch.float32 else 1e-9})


def test_remainder_by_a_denormal_is_exact():
    """Defect 7: ``remainder(1.0000001, 1e-40)`` was -inf (``x - floor(x / y) * y``); PyTorch's is C's fmod, adjusted.
    (One element: PyTorch's vector path gives NaN for a denormal divisor, its scalar path the exact remainder.)"""
    x, y = torch.tensor([1.0000001]), torch.tensor([1e-40])
    om = ortlab.ORTModule(Rows({"remainder": lambda t: torch.remainder(t[0], t[1])}))
    out = om(torch.stack([x, y])[None])[0]
    _ran_in_onnxruntime(om)
    assert out.tolist() == torch.remainder(x, y).tolist()


# ---------------------------------------------------------------------------------------------------- attention
class Attention(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, dtype=dtype)

    def forward(self, x: torch.Tensor, bool_mask: torch.Tensor, float_mask: torch.Tensor,
                padding: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        causal_and_padding = torch.ones(4, 4, dtype=torch.bool).tril() & padding[:, None, None, :]
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask),
                F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask),
                F.scaled_dot_product_attention(q, k, v, attn_mask=causal_and_padding),
                F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_with_fully_masked_rows_gives_zeros_and_finite_gradients(dtype):
    """Defect 5: a query row whose keys are all masked was NaN, and so was every parameter's gradient."""
    torch.manual_seed(0)
    eager = Attention(dtype)
    om = ortlab.ORTModule(Attention(dtype))
    om.load_state_dict(eager.state_dict())
    bool_mask = torch.tensor([[True] * 4, [False] * 4, [True, False, True, True], [True] * 4])
    float_mask = torch.zeros(4, 4, dtype=dtype).masked_fill(~bool_mask, -INF)
    padding = torch.tensor([[False, True, True, True], [False, False, False, False]])  # left pad; all padding
    x = torch.randn(2, 4, 8, dtype=dtype)
    outs = []
    for m in (eager, om):
        out = m(x, bool_mask, float_mask, padding)
        sum((o * o).sum() for o in out).backward()
        outs.append(out)
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1e-10, 1e-12)
    for i, (a, e) in enumerate(zip(outs[1], outs[0], strict=True)):
        _assert_same(f"attention output {i}", a.detach(), e.detach(), rtol, atol, signed_zeros=True)
    _ran_in_onnxruntime(om)
    for (name, p), q in zip(eager.named_parameters(), om.parameters(), strict=True):
        assert q.grad.isfinite().all(), name
        _assert_same(f"{name} gradient", q.grad, p.grad, rtol, atol, signed_zeros=False)


def test_multihead_attention_with_a_sequence_all_padding_matches_eager():
    """nn.MultiheadAttention's fused path (need_weights=False, the flash kernel traced as math) gives 0 for an
    all-padding sequence and finite gradients, as eager. (With need_weights=True it computes its own softmax:
    NaN in eager, and here.)"""
    torch.manual_seed(0)

    class MHA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, key_padding_mask=padding, need_weights=False)[0]

    eager = MHA()
    om = ortlab.ORTModule(MHA())
    om.load_state_dict(eager.state_dict())
    x = torch.randn(2, 4, 8)
    padding = torch.tensor([[True] * 4, [False, False, True, True]])
    results = []
    for m in (eager, om):
        out = m(x, padding)
        out.pow(2).sum().backward()
        results.append((out.detach(), [p.grad for p in m.parameters()]))
    _ran_in_onnxruntime(om)
    (e_out, e_grads), (o_out, o_grads) = results
    assert (e_out[0] == 0).all()
    _assert_same("output", o_out, e_out, 1e-5, 1e-6, signed_zeros=True)
    for a, e in zip(o_grads, e_grads, strict=True):
        assert a.isfinite().all()
        _assert_same("gradient", a, e, 1e-5, 1e-6, signed_zeros=False)


# ------------------------------------------------------------------------------------------------------ pooling
class Pools(nn.Module):
    def forward(self, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (F.avg_pool2d(x, 2, divisor_override=3),
                F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False, divisor_override=5),
                F.avg_pool2d(x, (2, 3), stride=1, padding=(1, 1), divisor_override=2),
                F.avg_pool3d(v, 2, divisor_override=5),
                F.avg_pool3d(v, 3, stride=2, padding=1, ceil_mode=True, divisor_override=7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_average_pooling_divides_by_divisor_override(dtype):
    """Defect 6: divisor_override was ignored (1.0 where eager gives 4/3), forward and backward."""
    torch.manual_seed(0)
    x, v = torch.randn(2, 3, 7, 6, dtype=dtype), torch.randn(1, 2, 5, 4, 6, dtype=dtype)
    results = []
    om = ortlab.ORTModule(Pools())
    for m in (Pools(), om):
        xi, vi = x.clone().requires_grad_(), v.clone().requires_grad_()
        outs = m(xi, vi)
        sum((o * torch.arange(o.numel(), dtype=dtype).reshape(o.shape)).sum() for o in outs).backward()
        results.append(([o.detach() for o in outs], xi.grad, vi.grad))
    _ran_in_onnxruntime(om)
    rtol, atol = _tolerances(dtype)
    for i, (a, e) in enumerate(zip(results[1][0], results[0][0], strict=True)):
        _assert_same(f"pool {i}", a, e, rtol, atol, signed_zeros=False)
    _assert_same("2-D gradient", results[1][1], results[0][1], rtol, atol, signed_zeros=False)
    _assert_same("3-D gradient", results[1][2], results[0][2], rtol, atol, signed_zeros=False)


# ---------------------------------------------------------------------------------------------------- overflow
OVERFLOW_ROWS = [[1e20, 1e20, -1e20, 3e20, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0], [1e19, 2e19, 3e19, 4e19, 5e19],
                 [-1e20, -2e20, -3e20, 1.0, 2.0]]
STATISTICS: dict[str, Op] = {
    "var": lambda x: x.var(1),
    "std": lambda x: x.std(1),
    "var_mean": lambda x: torch.var_mean(x, 1, correction=0)[0],
    "std_mean": lambda x: torch.std_mean(x, 1)[0],
    # rows of 5 take PyTorch's scalar Welford on every CPU: NaN where the mean's square overflows
    "layer_norm": lambda x: F.layer_norm(x, (5,)),
    "group_norm": lambda x: F.group_norm(x.reshape(1, 4, 5), 4).reshape(4, 5),
}


def test_float32_statistics_that_overflow_match_eager():
    """Defect 13: a variance past float32's range gave layer_norm zeros (eager: NaN) and std inf (eager: 3.78e29)."""
    x = torch.tensor([OVERFLOW_ROWS] * len(STATISTICS))
    _compare(STATISTICS, x, grad=False)
    # the gradient of a layer whose variance overflowed is NaN, as eager's, not zeros
    _compare({"layer_norm": STATISTICS["layer_norm"]}, x[:1], rtol=1e-5, atol=1e-6)


class _Pools(nn.Module):
    def forward(self, x2: torch.Tensor, x3: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*F.max_pool2d(x2, 2, return_indices=True), *F.max_pool2d(x2, 3, 1, 1, 2, return_indices=True),
                *F.max_pool2d(x2[0], 2, return_indices=True), *F.max_pool3d(x3, 2, return_indices=True),
                F.max_pool2d(x2, 3, 2, ceil_mode=True))


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pools_over_a_nan_take_its_index_and_send_its_gradient_there(dtype, dynamic):
    """Note [A max pool's NaN and its index]: a window holding NaNs is NaN, its index the last NaN's (in raster
    order), and the gradient goes there; windows with one, two or no NaN, with padding, dilation and ceil mode; marks
    in float32 for sizes known small, float64 for symbolic ones."""
    gen = torch.Generator().manual_seed(0)
    x2 = torch.randn(2, 3, 7, 7, generator=gen, dtype=dtype)
    x2[torch.rand(x2.shape, generator=gen) < 0.08] = NAN
    x3 = torch.randn(1, 2, 4, 4, 4, generator=gen, dtype=dtype)
    x3[torch.rand(x3.shape, generator=gen) < 0.05] = NAN
    results = []
    for module in (_Pools(), ortlab.ORTModule(_Pools(), dynamic=dynamic)):
        a, b = x2.clone().requires_grad_(), x3.clone().requires_grad_()
        outs = module(a, b)
        sum(o.nan_to_num(0.0).mul(1.5).sum() for o in outs if o.is_floating_point()).backward()
        results.append((outs, a.grad, b.grad))
    (outs_e, *grads_e), (outs_o, *grads_o) = results
    assert any(o.isnan().any() for o in outs_e if o.is_floating_point())
    for i, (o, e) in enumerate(zip(outs_o, outs_e)):
        _assert_same(f"output {i}", o, e, 0, 0, signed_zeros=True)
    for o, e in zip(grads_o, grads_e):
        torch.testing.assert_close(o, e, rtol=0, atol=0, equal_nan=True)


class _Splits(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return a.max(), b.min(), c.median(), d.nanmedian()


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_even_split_of_a_negative_gradient_leaves_positive_zeros(dtype):
    """Note [An even split of the gradient as the CPU kernel writes it]: max(), min(), median() and nanmedian()
    over all elements, with ties and a NaN, backward from a negative gradient: +0.0 where eager's CPU kernel has
    (each its own input: a sum of the inputs' gradients would add +0.0 to every -0.0)."""
    rows = ([1.0, 3.0, 3.0, -2.0], [0.5, -4.0, -4.0, 2.0], [1.0, 2.0, 3.0, 4.0], [NAN, 1.0, 2.0, 3.0])
    grads = []
    for module in (_Splits(), ortlab.ORTModule(_Splits())):
        inputs = [torch.tensor(r, dtype=dtype, requires_grad=True) for r in rows]
        sum(-1.5 * o for o in module(*inputs)).backward()
        grads.append([t.grad for t in inputs])
    for i, (ours, eager) in enumerate(zip(*grads)):
        _assert_same(f"gradient {i}", ours, eager, 0, 0, signed_zeros=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_angle_keeps_nan(dtype):
    x = torch.tensor([NAN, -1.0, 0.0, -0.0, 2.0, -INF, INF], dtype=dtype)
    got, expected = ortlab.ORTModule(_Angle())(x), _Angle()(x)
    _assert_same("angle", got, expected, 0, 0, signed_zeros=True)


class _Angle(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.angle(x)


class _Spectrum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x).abs()


def test_fourier_transforms_run_in_pytorch_with_the_reason():
    """Note [Fourier transforms stay in PyTorch]: eager's numbers, and the reason in the report."""
    x = torch.randn(5, 6, 7)
    om = ortlab.ORTModule(_Spectrum())
    torch.testing.assert_close(om(x), _Spectrum()(x), rtol=1e-6, atol=1e-6)
    assert any("pocketfft" in f.reason for f in om.report.fallbacks), om.report.fallbacks


class _Celu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.celu(x, alpha=0.8)


def _output_and_gradient(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``module(x)`` and x's gradient under a -1.25 cotangent (a negative one: zeros of the gradient show its sign)."""
    a = x.clone().requires_grad_()
    out = module(a)
    out.backward(torch.full_like(out, -1.25))
    return out.detach(), a.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_celu_keeps_positive_inputs_as_they_are(dtype):
    """celu is elu(x, alpha, 1, 1/alpha): torchlib's elu scaled the positive side by 1/alpha too (3 -> 3.75)."""
    x = torch.tensor([-100.0, -3.0, -0.5, -0.0, 0.0, 0.5, 3.0, 100.0, INF, -INF], dtype=dtype)
    results = [_output_and_gradient(m, x) for m in (_Celu(), ortlab.ORTModule(_Celu()))]
    rtol, atol = _tolerances(dtype)
    _assert_same("celu", results[1][0], results[0][0], rtol, atol, signed_zeros=True)
    _assert_same("celu's gradient", results[1][1], results[0][1], rtol, atol, signed_zeros=True)


class _PRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.25]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prelu_keeps_negative_zero(dtype):
    x = torch.tensor([-0.0, 0.0, -2.0, 3.0, NAN, -INF], dtype=dtype)
    module = _PRelu().to(dtype)
    _assert_same("prelu", ortlab.ORTModule(copy.deepcopy(module))(x).detach(), module(x).detach(), 0, 0,
                 signed_zeros=True)


class _Softshrink(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softshrink(x, 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softshrink_s_band_is_positive_zero_as_pytorch_s_vector_path(dtype):
    """64 elements: every one on PyTorch's vectorized path, which writes +0.0 in the band (torch's decomposition
    wrote ``x * 0``: -0.0 for each negative input there); NaN stays NaN."""
    x = torch.tensor([-0.3, -0.0, 0.0, 0.3, -0.5, 0.5, -0.7, 0.7], dtype=dtype).repeat(8)
    x[13] = NAN
    results = [_output_and_gradient(m, x) for m in (_Softshrink(), ortlab.ORTModule(_Softshrink()))]
    _assert_same("softshrink", results[1][0], results[0][0], 0, 0, signed_zeros=True)
    _assert_same("softshrink's gradient", results[1][1], results[0][1], 0, 0, signed_zeros=True)


class _Entr(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.entr(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_entr_keeps_eager_s_negative_zero_at_one(dtype):
    """``-1 * log(1)`` is -0.0, selected from a Where's first branch beside a Where of constants (0, -inf): the
    branches are swapped so onnxruntime keeps it."""
    x = torch.tensor([1.0, 0.0, -0.0, 0.5, -1.0, NAN, INF, 1.0], dtype=dtype)
    _assert_same("entr", ortlab.ORTModule(_Entr())(x), _Entr()(x), 0, 0, signed_zeros=True)


class _Trig(torch.nn.Module):
    def forward(self, x: torch.Tensor, r: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cos(x), torch.sin(x), torch.polar(r, x)]


def test_float64_sine_and_cosine_keep_libm_s_values_near_their_zeros():
    """onnxruntime's float64 Cos(pi/2) is 0.0 (libm: 6.1e-17): they run in PyTorch, with the reason."""

    x = torch.tensor([math.pi / 2, -math.pi / 2, math.pi, -7.853970918853729], dtype=torch.float64)
    r = torch.tensor([0.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    om = ortlab.ORTModule(_Trig())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = om(x, r)
    for g, e in zip(got, _Trig()(x, r)):
        assert torch.equal(torch.view_as_real(g) if g.is_complex() else g,
                           torch.view_as_real(e) if e.is_complex() else e), (g, e)
    reasons = " ".join(f.reason for f in om.report.fallbacks)
    assert "float64 Sin and Cos" in reasons, reasons


class _TopK(torch.nn.Module):
    def forward(self, x):
        values, indices = x.topk(3)
        return values, indices


class _TopKValues(torch.nn.Module):
    def forward(self, x):
        return x.topk(3).values * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_topk_of_ties_gives_eager_s_indices_and_gradients(dtype):
    """The whole OpInfo sweep: topk of int64 samples with repeated values had other indices (eager 8, ortlab 4).
    Note [topk's ties]: a topk whose indices are read runs in PyTorch, with the reason."""
    x = torch.zeros(4, 10, dtype=dtype)
    x[:, ::3] = 1
    om = ortlab.ORTModule(_TopK())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values, indices = om(x)
    expected = _TopK()(x)
    assert torch.equal(values, expected[0]) and torch.equal(indices, expected[1]), (indices, expected[1])
    assert any("ONNX TopK takes the lowest first" in f.reason for f in om.report.fallbacks)
    if dtype.is_floating_point:  # the gradient goes where eager's goes
        leaf = x.clone().requires_grad_()
        eager_leaf = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ortlab.ORTModule(_TopKValues())(leaf).sum().backward()
        _TopKValues()(eager_leaf).sum().backward()
        assert torch.equal(leaf.grad, eager_leaf.grad)


def test_topk_values_alone_stay_in_onnxruntime():
    x = torch.zeros(4, 10)
    om = ortlab.ORTModule(_TopKValues())
    with torch.no_grad():
        assert torch.equal(om(x), _TopKValues()(x))
    assert not om.report.fallbacks
