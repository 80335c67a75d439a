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


# ----------------------------------------------------------------------------- ranges, masks, complex constants
def _run(fn, args: tuple, **options) -> tuple[object, list[str], ortlab.ORTModule]:  # noqa: ANN001
    """ORTModule's result (or exception) on ``args``, the FallbackWarnings it gave, and the module."""
    import warnings

    from ortlab.errors import FallbackWarning

    module = ortlab.ORTModule(_Fn(fn), **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = module(*args)
        except Exception as e:  # noqa: BLE001
            out = e
    return out, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)], module


I16, I8 = torch.tensor(0, dtype=torch.int16), torch.tensor(0, dtype=torch.int8)
EXACT = {
    # Note [Integer linspace as PyTorch's kernel]: start + step * i rounded once (a fused multiply-add)
    "linspace int64, rounded once": (lambda x: torch.linspace(-866081, 893750, 1000, dtype=torch.int64) + x,
                                     (torch.tensor(0),)),
    "linspace int16, rounded once": (lambda x: torch.linspace(-2626, 1572.9999372271895, 13, dtype=torch.int16) + x,
                                     (I16,)),
    "linspace int8, tensor start": (lambda s: torch.linspace(s, -86, 50, dtype=torch.int8), (torch.tensor(40.36),)),
    "linspace uint8, -1 wraps": (lambda s, e: torch.linspace(s, e, 5, dtype=torch.uint8), (torch.tensor(-1),
                                                                                        torch.tensor(10))),
    "linspace int64, one step": (lambda s: torch.linspace(s, 3.0, 1, dtype=torch.int64), (torch.tensor(2 ** 62 + 7),)),
    # a Python float start failed to capture (torch.tensor in the decomposition)
    "linspace int64, float start": (lambda x: torch.linspace(-2.0, -3, 50, dtype=torch.int64) + x, (torch.tensor(0),)),
    # a tensor's ends into a float dtype: torch's decomposition (ortlab's integer one had replaced it)
    "linspace float32, tensor ends": (lambda s, e: torch.linspace(s, e, 7), (torch.tensor(0.5), torch.tensor(3.0))),
    # float64 arange(end): exact float64 numbers (torchlib's held them in float32: in PyTorch)
    "arange float64, end only": (lambda x: torch.arange(3.1, dtype=torch.float64) + x,
                                 (torch.tensor(0.0, dtype=torch.float64),)),
    # Note [uint8 indices are masks]: torchlib took them for positions (onnxruntime refused the model)
    "index_put, uint8 mask": (lambda x, m, v: x.index_put((m,), v), (torch.zeros(3, 4), torch.tensor([1, 0, 1],
                              dtype=torch.uint8), torch.arange(4.0))),
    "index_put, uint8 mask, accumulate": (lambda x, m, v: x.index_put((m,), v, accumulate=True),
                                          (torch.ones(3, 4), torch.tensor([1, 0, 1], dtype=torch.uint8),
                                           torch.arange(4.0))),
    # a bool mask's accumulate: ortlab's ScatterElements took it for positions (onnxruntime refused the model)
    "index_put, bool mask, accumulate": (lambda x, m, v: x.index_put((m,), v, accumulate=True),
                                         (torch.ones(3, 4), torch.tensor([True, False, True]), torch.arange(4.0))),
    # onnxruntime's CPU ScatterElements has no bool kernel with a reduction (it failed at run time)
    **{f"scatter_reduce {r}, bool": (lambda x, i, s, r=r: torch.scatter_reduce(x, 0, i, s, r, include_self=inc),
                                     (torch.tensor([[True, False], [False, False], [True, True]]),
                                      torch.tensor([[0, 1], [0, 0], [2, 1]]),
                                      torch.tensor([[False, True], [True, True], [False, False]])))
       for r in ("amax", "amin", "sum", "prod") for inc in (True,)},
}


@pytest.mark.parametrize("name", list(EXACT))
def test_runs_in_onnxruntime_as_eager(name):
    fn, args = EXACT[name]
    expected = _Fn(fn)(*args)
    got, warned, module = _run(fn, args)
    assert not warned and not module.report.fallbacks, (warned, module.report.fallbacks)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
    assert torch.equal(got, expected), (got, expected)


BYTE_MASK = "masked_fill_ only supports boolean masks, but got mask with dtype unsigned char"
ERRORS = {
    # Note [PyTorch's errors found at capture]: no FallbackWarning, and no CaptureError under fallback="raise"
    "masked_scatter, uint8 mask": (lambda x, m, s: x.masked_scatter(m, s),
                                   (torch.zeros(1, 3), torch.tensor([[1, 0, 1]], dtype=torch.uint8), torch.ones(3, 4)),
                                   "masked_scatter_ only supports boolean masks, but got mask with dtype Byte"),
    "index_put, uint8 mask, one value": (lambda x, m: x.index_put((m,), torch.tensor(5.0)),
                                         (torch.zeros(3), torch.tensor([1, 0, 1], dtype=torch.uint8)), BYTE_MASK),
    "linspace int8, a number out of range": (lambda x: torch.linspace(300, 5, 7, dtype=torch.int8) + x, (I8,),
                                            "value cannot be converted to type int8_t without overflow"),
    "scatter_reduce mean, bool": (lambda x, i: torch.scatter_reduce(x, 0, i, x, "mean"),
                                  (torch.tensor([True, False]), torch.tensor([0, 0])),
                                  "\"scatter_gather_tensor_cpu_reduce_mean\" not implemented for 'Bool'"),
    "linspace int32, NaN": (lambda x: torch.linspace(float("nan"), 5, 7, dtype=torch.int32) + x,
                            (torch.tensor(0, dtype=torch.int32),), "value cannot be converted to type int without"),
}


@pytest.mark.parametrize("name", list(ERRORS))
@pytest.mark.parametrize("fallback", ["warn", "raise"])
def test_pytorch_s_error_found_at_capture_is_raised_as_it_is(name, fallback):
    fn, args, message = ERRORS[name]
    with pytest.raises(RuntimeError, match=message) as eager:
        _Fn(fn)(*args)
    got, warned, _ = _run(fn, args, fallback=fallback)
    assert type(got) is type(eager.value) and message in str(got), repr(got)
    assert not warned, warned


def test_a_tensor_end_out_of_the_dtype_raises_pytorch_s_error_after_the_run():
    fn = lambda s: torch.linspace(s, 5, 7, dtype=torch.int8)  # noqa: E731
    message = "value cannot be converted to type int8_t without overflow"
    for bad in (torch.tensor(300.0), torch.tensor(float("nan"))):
        with pytest.raises(RuntimeError, match=message):
            _Fn(fn)(bad)
    module = ortlab.ORTModule(_Fn(fn))
    assert torch.equal(module(torch.tensor(-7.5)), _Fn(fn)(torch.tensor(-7.5)))
    for bad in (torch.tensor(300.0), torch.tensor(float("nan"))):
        with pytest.raises(RuntimeError, match=message):
            module(bad)
    assert not module.report.fallbacks


def test_linspace_integer_is_pytorch_s_kernel_on_random_ends():
    """The decomposition itself, run eagerly, against PyTorch's kernel (errors included)."""
    import random

    from ortlab.capture.ranges import linspace_integer

    rng = random.Random(0)
    for _ in range(400):
        dtype = rng.choice([torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
        lo, hi = {torch.uint8: (-300, 300), torch.int8: (-140, 140), torch.int16: (-33000, 33000),
                  torch.int32: (-2 ** 31 - 5, 2 ** 31 + 5)}.get(dtype, (-2 ** 62, 2 ** 62))
        ends = [rng.choice([rng.randint(lo, hi), rng.uniform(lo, hi), torch.tensor(rng.uniform(lo, hi))])
                for _ in range(2)]
        steps = rng.choice([1, 2, 3, 13, 50, 1000, rng.randint(1, 3000)])
        results = []
        for fn in (torch.linspace, linspace_integer):
            try:
                results.append(fn(*ends, steps, dtype=dtype))
            except RuntimeError as e:
                results.append(str(e))
        expected, got = results
        assert type(expected) is type(got) and (expected == got if isinstance(got, str)
                                                else torch.equal(expected, got)), (ends, steps, dtype)


def test_complex_numbers_run_their_op_in_pytorch_and_the_rest_in_onnxruntime():
    """Note [Complex constants stay in PyTorch]: the session was refused and the whole graph ran in PyTorch, or
    (a complex alpha) the value was silently wrong."""
    x = torch.randn(4, 3)
    z = torch.complex(x, x.flip(0))
    cases = [(lambda x: torch.where(x > 0, 2j, x).abs() * 2, (x,)),
             (lambda x: torch.view_as_real(torch.zeros(3, dtype=torch.complex64) + torch.complex(x[0], x[1])) * 2,
              (x,)),
             (lambda z: torch.view_as_real(torch.add(z, z, alpha=2j)) * 2, (z,))]
    for fn, args in cases:
        expected = _Fn(fn)(*args)
        got, _, module = _run(fn, args)
        torch.testing.assert_close(got, expected)
        fallbacks = module.report.fallbacks
        assert fallbacks and all(fb.scope == "op" for fb in fallbacks), fallbacks
        assert any(fb.kind == "known_wrong" and "no complex type" in fb.reason for fb in fallbacks), fallbacks
    # torchlib's complex ops on their float pairs, a complex ``other`` included, stay in onnxruntime
    for fn in (lambda z: torch.view_as_real(z * (1 + 1j) + 1j) * 2, lambda z: (z * z).real + z.abs()):
        got, _, module = _run(fn, (z,))
        torch.testing.assert_close(got, _Fn(fn)(z))
        assert not module.report.fallbacks, module.report.fallbacks


def test_dropout_s_backward_of_an_integer_gradient_keeps_eager_s_zeros():
    """Eager masks first (an integer 0), then scales: +0.0 where ``grad * (mask * scale)`` gave -0.0."""
    class Back(nn.Module):
        def forward(self, g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.native_dropout_backward(g, m, 2.0)

    g, m = torch.tensor([-8, 6, -5, 0, 3]), torch.tensor([False, True, False, True, True])
    got, expected = ortlab.ORTModule(Back())(g, m), Back()(g, m)
    assert torch.equal(got, expected) and torch.equal(torch.signbit(got), torch.signbit(expected))
