"""Decompositions that keep PyTorch's results where floating point runs out: NaN, infinities, signed zeros, the
boundaries of piecewise functions, and finite inputs whose textbook formula overflows or cancels.

Each function is traced in place of the op (``ortlab.capture.decompositions.decomposition_table`` adds
:func:`float_edge_decompositions`) and computes what PyTorch's CPU kernel computes, with ops whose ONNX
translations are exact; ``NotImplemented`` keeps the op where a case is not covered (integers, complex).
The forward is replaced, the backward stays autograd's formula for the op (itself traced through these).

Two rules hold for every function here:

* Note [Where keeps -0.0 from its second branch only]
* constants are made with :func:`_const` (``scalar_tensor``, which ortlab translates exactly in every
  dtype): a Python float beside a float64 tensor would otherwise become a float32 constant.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from ortlab._compat.torch import OpOverload

__all__ = ["float_edge_decompositions", "even_splits_as_on_cpu", "hardtanh_backward", "hardswish_backward", "hardsigmoid_backward",
           "elu_backward", "leaky_relu_backward", "prelu_kernel_backward", "celu", "sign", "atan2", "trunc", "frac",
           "heaviside", "remainder", "div_mode", "clamp_min",
           "clamp_max", "clamp", "vector_norm_inf", "log_softmax_float64", "logaddexp", "logaddexp2", "logcumsumexp",
           "log1p", "expm1", "sigmoid", "silu", "softplus", "xlogy", "erfc", "erfcx", "log_ndtr", "pow_root",
           "var_float32_in_float64", "std_float32_in_float64", "avg_pool_divisor_override"]

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64)

# Note [Where keeps -0.0 from its second branch only]
# onnxruntime's CPU ``Where`` writes +0.0 where it selects a -0.0 from its first branch (X); a -0.0 from
# its second branch (Y) stays -0.0 (every size and broadcast, float and double; checked on bare
# onnxruntime graphs). PyTorch's ``where`` keeps both. So where a selected value may be a -0.0 that the
# result must keep (``trunc(-0.5)``, ``remainder(-0.0, 1)``, ``atan2(-0.0, 1)``), it is the second
# branch: ``where(c, other, keeps_its_sign)``. Gradients (whose zeros' signs no later op reads) put
# the common case second where both branches may hold one. The condition must not be a ``Not``
# (``~c``, ``a != b``): onnxruntime's optimizer folds ``Where(Not(c), x, y)`` into ``Where(c, y, x)``, which
# swaps the branches back; ``|a| > 0`` stands for ``a != 0``.


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype (exact: ortlab's ``scalar_tensor`` translation)."""
    return torch.scalar_tensor(value, dtype=like.dtype, device=like.device)


def _floating(*tensors: object) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype in _FLOATS for t in tensors)


def _positive(x: torch.Tensor) -> torch.Tensor:
    """Positive numbers and +0.0 (NaN neither this nor :func:`_negative`), with no ``Not``."""
    return (x > 0) | ((x == 0) & (torch.reciprocal(x) > 0))


def _negative(x: torch.Tensor) -> torch.Tensor:
    """The sign bit of ``x`` but a NaN's (which no ONNX operator reads): ``x < 0``, or ``-0.0`` (``1 / x`` is -inf)."""
    return (x < 0) | ((x == 0) & (torch.reciprocal(x) < 0))


# ------------------------------------------------------------------------------------------------ boundaries
# Note [Gradients at a clip's boundary]
# torchlib's ``hardtanh_backward`` masks ``x > max`` and ``x < min``; PyTorch's kernel masks ``x >= max``
# and ``x <= min`` (and NaN): at exactly x = 6 (a ReLU6 saturated at its bound, common in MobileNets after a
# quantization-aware clamp) eager's gradient is 0 and ours was the incoming gradient, and its masks were
# multiplies (an inf or NaN gradient made NaN where eager writes 0). float64 ran in PyTorch and was right.
# Each activation's gradient here is PyTorch's vectorized kernel's, comparison for comparison: which side
# a boundary belongs to, and which branch a NaN input takes (``elu``'s and ``hardswish``'s give NaN, as
# their vector paths do; the scalar tail of a kernel may differ, and the vector path is what almost every
# element takes).
def hardtanh_backward(grad_output: torch.Tensor, self: torch.Tensor, min_val: float, max_val: float) -> object:
    """The gradient strictly inside ``(min_val, max_val)``, 0 at the bounds, beyond and for NaN (Note [Gradients at
    a clip's boundary])."""
    if not _floating(grad_output, self):
        return NotImplemented
    inside = (self > _const(min_val, self)) & (self < _const(max_val, self))
    return torch.where(inside, grad_output, _const(0.0, grad_output))


def hardswish_backward(grad_output: torch.Tensor, self: torch.Tensor) -> object:
    """0 up to -3, the incoming gradient from 3 on, ``g * (x / 3 + 1/2)`` between (and for NaN)."""
    if not _floating(grad_output, self):
        return NotImplemented
    middle = grad_output * (self / 3 + 0.5)
    inner = torch.where(self >= 3, grad_output, middle)
    return torch.where(self <= -3, _const(0.0, grad_output), inner)


# PyTorch's kernel multiplies by ``1.0f / 6.0f``, a float32 constant, in float64 too (the float64 gradient
# was 1.8e-8 off eager's with an exact 1/6).
_ONE_SIXTH = float(np.float32(1.0) / np.float32(6.0))


def hardsigmoid_backward(grad_output: torch.Tensor, self: torch.Tensor) -> object:
    """``g / 6`` strictly inside (-3, 3), 0 elsewhere and for NaN, with PyTorch's float32 1/6."""
    if not _floating(grad_output, self):
        return NotImplemented
    inside = (self > -3) & (self < 3)
    return torch.where(inside, grad_output * _const(_ONE_SIXTH, grad_output), _const(0.0, grad_output))


def elu_backward(grad_output: torch.Tensor, alpha: float, scale: float, input_scale: float, is_result: bool,
                 self_or_result: torch.Tensor) -> object:
    """``elu``/``celu``/``selu``'s gradient: the positive branch for ``x > 0`` only, so a NaN input takes the
    negative branch and gives NaN, as PyTorch's vectorized kernel (its scalar tail, the last few elements of a
    tensor, passes a NaN input's gradient on; torch's decomposition tests ``x <= 0``)."""
    if not _floating(grad_output, self_or_result):
        return NotImplemented
    x = self_or_result
    negcoef, poscoef, negiptcoef = (_const(alpha * scale, x), _const(scale, x), _const(input_scale, x))
    if is_result:
        negative = grad_output * negiptcoef * (x + negcoef)
    else:
        negative = grad_output * negiptcoef * negcoef * torch.exp(x * negiptcoef)
    return torch.where(x > 0, grad_output * poscoef, negative)


def elu(self: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> object:
    """``elu`` as PyTorch's kernel: ``x * scale`` above 0, ``alpha * scale * expm1(x * input_scale)`` at or below
    (torchlib scaled the positive side by ``input_scale`` too: ``celu(3, alpha=0.8)`` was 3.75; its negative side in
    Where's second branch keeps ``elu(-0.0)`` -0.0)."""
    if not _floating(self) or not all(isinstance(v, (int, float)) for v in (alpha, scale, input_scale)):
        return NotImplemented
    negative = _const(alpha * scale, self) * torch.expm1(self * _const(input_scale, self))
    return torch.where(self > 0, self * _const(scale, self), negative)


def prelu_kernel(self: torch.Tensor, weight: torch.Tensor) -> object:
    """``_prelu_kernel`` as PyTorch's: ``x`` above 0, ``weight * x`` at or below, in Where's second branch (a -0.0
    input gives ``weight * -0.0``; float64's form had lost its sign)."""
    if not _floating(self, weight):
        return NotImplemented
    return torch.where(self > 0, self, weight * self)


# Note [softshrink's zeros as PyTorch's vector path]
# PyTorch's softshrink kernel writes +0.0 inside the band [-lambd, lambd] in its vectorized loop (a blend of
# masks) and ``x * 0`` in its scalar tail (a tensor's last elements past the last full vector), -0.0 for a
# negative x; torch's decomposition is the tail's ``x * 0`` everywhere, so most of a large tensor's zeros had
# the wrong sign. The band is ``|x| * 0`` here: +0.0, and NaN for a NaN, as the vector path; it carries no
# gradient, so the input's gradient is ``where(|x| > lambd, g, 0)``: +0.0 in the band, as PyTorch's backward.
# Tensors shorter than a vector (all tail) keep -0.0 in eager: a known difference, as for the activations'
# gradients at NaN. torch's decomposition runs at the Autograd key, before any table sees softshrink, so the
# call is rewritten in the Dynamo graph (ortlab.capture.aot.rewrite_calls), and the table has it for graphs
# traced without autograd.
def softshrink(self: torch.Tensor, lambd: float = 0.5) -> object:
    """``where(|x| > lambd, x - sign(x) * lambd, |x| * 0)`` (Note [softshrink's zeros as PyTorch's vector path])."""
    if not _floating(self) or not isinstance(lambd, (int, float)) or not 0 <= lambd <= torch.finfo(self.dtype).max:
        return NotImplemented
    band = (torch.abs(self) * 0).detach()
    return torch.where(torch.abs(self) > lambd, self - torch.sign(self) * lambd, band)


def softshrink_call(input: torch.Tensor, lambd: float = 0.5) -> torch.Tensor:
    """What a captured ``F.softshrink`` call runs: :func:`softshrink`, or PyTorch's op where it does not apply
    (its checks and errors)."""
    out = softshrink(input, lambd)
    return torch.nn.functional.softshrink(input, lambd) if out is NotImplemented else out


# Note [A slope's gradient as a product]
# ``leaky_relu``'s and ``prelu``'s input gradient is ``x > 0 ? g : g * slope`` (PyTorch's kernels; torch's
# decompositions ``where(x > 0, g, g * slope)``). Both branches may be -0.0 (``g = -0.0``; ``g * slope`` for a
# negative ``g`` and a zero slope), and a -0.0 from Where's first branch comes out +0.0 in onnxruntime (Note [A
# -0.0 from Where's first branch] in ortlab.runtime.cpu_rewrites). ``g * (x > 0 ? 1 : slope)`` is the same
# numbers, each one product rounded once (``g * 1`` is ``g``, -0.0 and NaN included), with the select between
# constants, or the slope, where no -0.0 is lost.
def leaky_relu_backward(grad_output: torch.Tensor, self: torch.Tensor, negative_slope: float,
                        self_is_result: bool) -> object:
    """``g * where(x > 0, 1, slope)`` (Note [A slope's gradient as a product])."""
    if not _floating(grad_output, self) or grad_output.dtype != self.dtype or not isinstance(negative_slope,
                                                                                             (int, float)):
        return NotImplemented
    factor = torch.where(self > 0, _const(1.0, grad_output), _const(negative_slope, grad_output))
    return grad_output * factor


def prelu_kernel_backward(grad_output: torch.Tensor, self: torch.Tensor, weight: torch.Tensor) -> object:
    """``_prelu_kernel_backward``: the input's gradient ``g * where(x > 0, 1, weight)`` (Note [A slope's gradient as
    a product]), the weight's torch's ``where(x > 0, 0, x * g)``."""
    if not _floating(grad_output, self, weight) or len({grad_output.dtype, self.dtype, weight.dtype}) != 1:
        return NotImplemented
    positive = self > 0
    input_grad = grad_output * torch.where(positive, _const(1.0, weight), weight)
    weight_grad = torch.where(positive, _const(0.0, grad_output), self * grad_output)
    return input_grad, weight_grad


def celu(self: torch.Tensor, alpha: float = 1.0) -> object:
    """``elu(x, alpha, 1, 1 / alpha)``, which is how PyTorch computes it (torchlib's ONNX ``Celu`` gave +0.0 for
    ``celu(-0.0)``, PyTorch's ``expm1(-0.0) * alpha`` -0.0)."""
    if not _floating(self) or not isinstance(alpha, (int, float)) or alpha == 0:
        return NotImplemented
    return torch.ops.aten.elu(self, alpha, 1.0, 1.0 / alpha)


# Note [Clamping to one bound]
# torchlib writes ``clamp_min(x, m)`` as ``Clip(x, m)`` with no max, and onnxruntime's Clip then clips to
# the dtype's largest finite value: ``x.clamp(min=0.5)`` turned +inf into 3.4e38 (float32), and
# ``clamp_max`` -inf into -3.4e38. The missing bound is given as the infinity it stands for.
def clamp_min(self: torch.Tensor, min: float) -> object:  # noqa: A002
    """``clamp(self, min, +inf)`` (Note [Clamping to one bound])."""
    if not _floating(self) or not isinstance(min, (int, float)):
        return NotImplemented
    return torch.clamp(self, float(min), math.inf)  # both floats: torch.onnx's type promotion mixes an int


def clamp_max(self: torch.Tensor, max: float) -> object:  # noqa: A002
    """``clamp(self, -inf, max)`` (Note [Clamping to one bound])."""
    if not _floating(self) or not isinstance(max, (int, float)):
        return NotImplemented
    return torch.clamp(self, -math.inf, float(max))


def clamp(self: torch.Tensor, min: float | None = None, max: float | None = None) -> object:  # noqa: A002
    """``clamp`` with one bound as :func:`clamp_min` or :func:`clamp_max`; with both, the op (``Clip``)."""
    if not _floating(self) or (min is None) == (max is None):
        return NotImplemented
    return clamp_max(self, max) if min is None else clamp_min(self, min)


# ---------------------------------------------------------------------------------- NaN and signed zeros
# Note [Signs of NaN and of zero]
# ONNX's ``Sign`` gives NaN for NaN where PyTorch's ``sign``/``sgn`` give 0 (``(0 < x) - (x < 0)``), so
# every ``abs`` gradient (``g * sgn(x)``: L1 losses, ``norm(p=1)``) was NaN at a NaN where eager's is 0.
# ``trunc`` and ``frac`` lost -0.0 (``trunc(-0.5)`` is -0.0 in PyTorch) and ``heaviside(nan, v)`` was 1
# where PyTorch's ``x == 0 ? v : x > 0`` is 0. torchlib's ``signbit`` is ``x < 0``, false for -0.0; -0.0 is
# told by ``1 / x < 0``, but a NaN's own sign bit is the one thing no ONNX operator reads (opset 18 has no
# BitCast), and x86 makes ``0 / 0`` a -nan: ``signbit``, and ``copysign`` with a floating ``other``, run in
# PyTorch (``ortlab.placement.KNOWN_WRONG``).
def sign(self: torch.Tensor) -> object:
    """``(x > 0) - (x < 0)``: 0 for NaN and for either zero (Note [Signs of NaN and of zero])."""
    if not _floating(self):
        return NotImplemented
    return (self > 0).to(self.dtype) - (self < 0).to(self.dtype)


def trunc(self: torch.Tensor) -> object:
    """``floor`` above 0, ``ceil`` otherwise: ``ceil(-0.5)`` is -0.0, kept in Where's second branch."""
    if not _floating(self):
        return NotImplemented
    return torch.where(self > 0, torch.floor(self), torch.ceil(self))


def frac(self: torch.Tensor) -> object:
    """``x - trunc(x)``, as PyTorch (``frac(-0.0)`` is +0.0, ``frac(inf)`` NaN)."""
    if not _floating(self):
        return NotImplemented
    return self - trunc(self)


def heaviside(self: torch.Tensor, values: torch.Tensor) -> object:
    """``x == 0 ? v : x > 0``: 0 for NaN, as PyTorch."""
    if not _floating(self, values):
        return NotImplemented
    dtype = torch.result_type(self, values)
    nonzero = (self > 0) | (self < 0) | torch.isnan(self)
    return torch.where(nonzero, (self > 0).to(dtype), values.to(dtype))


# Note [remainder from fmod]
# torchlib's ``remainder`` is ``x - floor(x / y) * y``: ``x / y`` overflows for a tiny divisor
# (``remainder(1.0000001, 1e-40)`` was -inf, PyTorch's 7.3e-41), ``floor(x / inf) * inf`` is NaN
# (``remainder(-1e30, -inf)`` is -1e30 in PyTorch), and -0.0 came out +0.0. PyTorch's kernel takes C's
# ``fmod`` (ONNX ``Mod(fmod=1)``, exact) and adds the divisor when the signs differ; so does this.
def remainder(self: torch.Tensor | float, other: torch.Tensor | float) -> object:
    """PyTorch's float ``remainder`` (Note [remainder from fmod])."""
    if isinstance(self, torch.Tensor) and isinstance(other, torch.Tensor):
        if not _floating(self, other):
            return NotImplemented
    elif isinstance(self, torch.Tensor) and isinstance(other, (int, float)) and _floating(self):
        other = _const(other, self)
    else:
        return NotImplemented
    mod = torch.fmod(self, other)
    adjust = (mod != 0) & ((other < 0) != (mod < 0))
    return torch.where(adjust, mod + other, mod)


def div_mode(self: torch.Tensor, other: torch.Tensor | float, *, rounding_mode: str | None = None) -> object:
    """``div`` with ``rounding_mode`` for floats as PyTorch's kernel: ``trunc(x / y)``, or its floor division from
    ``fmod`` (``div(-inf, 3, rounding_mode="floor")`` is NaN in PyTorch; ``floor(x / y)`` gave -inf)."""
    if not isinstance(other, torch.Tensor):
        if not _floating(self) or not isinstance(other, (int, float)):
            return NotImplemented
        other = _const(other, self)
    if not _floating(self, other) or rounding_mode not in ("trunc", "floor"):
        return NotImplemented
    if self.dtype != other.dtype:
        return NotImplemented
    quotient = self / other
    if rounding_mode == "trunc":
        return trunc(quotient)
    # c10's div_floor_floating, step for step
    mod = torch.fmod(self, other)
    div = (self - mod) / other
    div = torch.where((mod != 0) & ((other < 0) != (mod < 0)), div - 1, div)
    floor = torch.floor(div)
    floor = torch.where(div - floor > 0.5, floor + 1, floor)
    floor = torch.where(div.abs() > 0, floor, quotient * 0)  # a zero quotient keeps its sign (second branch)
    return torch.where(other == 0, quotient, floor)


def floor_divide(self: torch.Tensor, other: torch.Tensor | float) -> object:
    """``floor_divide`` of floats: :func:`div_mode` with ``"floor"``."""
    return div_mode(self, other, rounding_mode="floor")


def vector_norm_inf(self: torch.Tensor, ord: float = 2.0, dim: object = None, keepdim: bool = False,  # noqa: A002
                    *, dtype: torch.dtype | None = None) -> object:
    """``linalg_vector_norm`` with ``ord=±inf`` as ``amax``/``amin`` of ``|x|``, which ortlab translates with NaN
    propagating (onnxruntime's ReduceMax skips NaN: ``norm(p=inf)`` of a row with a NaN was its largest number)."""
    if not _floating(self) or not isinstance(ord, (int, float)):
        return NotImplemented
    if (dim is None or (isinstance(dim, (list, tuple)) and not dim)) and keepdim and self.dim() > 0:
        # every dim, kept: torchlib's translation dropped them (shape () for [1]; the backward then failed)
        return torch.ops.aten.linalg_vector_norm(self, ord, list(range(self.dim())), True, dtype=dtype)
    if not math.isinf(ord) or self.numel() == 0:
        return NotImplemented
    x = self.abs() if dtype is None else self.to(dtype).abs()
    dims = [] if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    reduce = torch.amax if ord > 0 else torch.amin
    return reduce(x, dims, keepdim)


# Note [log_softmax in float64]
# onnxruntime's float64 LogSoftmax kernel mishandles NaN and infinities: a row [1, nan, 3] came out
# [44.05, nan, 46.05] where PyTorch gives NaN throughout, and a float64 ``cross_entropy`` with a NaN logit
# gave a finite loss. Its float32 kernel is right (and is the hot path of every language model's loss), so
# only float64 is traced as PyTorch's kernel computes it: ``x - max - log(sum(exp(x - max)))`` with a max
# that propagates NaN (ortlab's ``amax``).
def log_softmax_float64(self: torch.Tensor, dim: int, half_to_float: bool) -> object:
    """``_log_softmax`` in float64 (Note [log_softmax in float64])."""
    if self.dtype != torch.float64 or half_to_float or self.dim() == 0:
        return NotImplemented
    shifted = self - torch.amax(self, dim, keepdim=True)
    return shifted - torch.log(torch.exp(shifted).sum(dim, keepdim=True))


# The angle of a real number is pi below zero and 0 otherwise; PyTorch's kernel keeps a NaN (torchlib's
# ``where(x < 0, pi, 0)`` made it 0).
def angle(self: torch.Tensor) -> object:
    """``angle`` of a real float tensor, NaN kept."""
    if not _floating(self):
        return NotImplemented
    return torch.where(torch.isnan(self), self, torch.where(self < 0, _const(math.pi, self), _const(0.0, self)))


# Note [atan2 from a ratio at most 1]
# torchlib's ``atan2`` is ``atan(y / x)`` plus pi by the signs of ``x < 0`` and ``y < 0``: ``atan2(+0, -1)``
# was -pi (PyTorch: +pi), ``atan2(0, -0)`` 0 (pi), ``atan2(x, nan)`` 0 (NaN), and both infinite 0 (pi/4).
# Here the C library's way: ``a = atan(min(|x|, |y|) / max(|x|, |y|))`` (no overflow; 0/0 is 0 and inf/inf
# 1), ``pi/2 - a`` where |y| > |x|, ``pi - a`` where x's sign bit is set (-0.0 included), and the sign of
# y (-0.0 included) last, in Where's second branch. A NaN stays NaN.
def atan2(self: torch.Tensor, other: torch.Tensor) -> object:
    """``atan2(y, x)`` with IEEE's signed zeros, infinities and NaN (Note [atan2 from a ratio at most 1])."""
    if not (isinstance(self, torch.Tensor) and isinstance(other, torch.Tensor)) or self.is_complex() \
            or other.is_complex():
        return NotImplemented
    out = torch.result_type(self, other)  # integers and bools: the default float (int 0 is +0.0: atan2(0, -3) = pi)
    out = out if out.is_floating_point else torch.get_default_dtype()
    self, other = self.to(out), other.to(out)
    ay, ax = self.abs(), other.abs()
    ratio = torch.minimum(ax, ay) / torch.maximum(ax, ay)
    same = torch.where(ax == 0, _const(0.0, ratio), _const(1.0, ratio))
    angle = torch.atan(torch.where(ax == ay, same, ratio))
    angle = torch.where(ay > ax, _const(math.pi / 2, angle) - angle, angle)
    angle = torch.where(_negative(other), _const(math.pi, angle) - angle, angle)
    return torch.where(_positive(self), angle, -angle)  # angle >= 0; -angle may be -0.0: second branch


# ------------------------------------------------------------------------------------------ stable formulas
# Note [log1p and expm1 without cancellation]
# ONNX has neither: torchlib writes ``log(1 + x)`` and ``exp(x) - 1``, which round ``1 + x``: log1p(1e-7)
# was 1.19e-7 (19% off), log1p(1e-30) and expm1(1e-30) were 0, and -0.0 came out +0.0. They are computed
# here with the classic corrections, exact to an ulp or two given ``Log`` and ``Exp``:
# * log1p(x) = log(u) * x / (u - 1) with u = 1 + x (Goldberg): the rounding of u cancels; x itself where
#   u == 1, +inf for +inf;
# * expm1(x) = (u - 1) * x / log(u) with u = exp(x) (Kahan): x where u == 1, -1 where u - 1 is -1, +inf
#   where exp overflows.
# softplus, log_sigmoid, ``binary_cross_entropy_with_logits`` and logaddexp reach them through torch's
# decompositions.
def log1p(self: torch.Tensor) -> object:
    """``log(1 + x)`` without rounding ``1 + x`` (Note [log1p and expm1 without cancellation])."""
    if not _floating(self):
        return NotImplemented
    u = self + 1
    d = u - 1
    corrected = torch.where(d.abs() > 0, torch.log(u) * (self / d), self)
    return torch.where(self == math.inf, self, corrected)


def expm1(self: torch.Tensor) -> object:
    """``exp(x) - 1`` without rounding ``exp(x)`` (Note [log1p and expm1 without cancellation])."""
    if not _floating(self):
        return NotImplemented
    u = torch.exp(self)
    um1 = u - 1
    corrected = torch.where(um1.abs() > 0, um1 * (self / torch.log(u)), self)
    corrected = torch.where(u == math.inf, u, corrected)  # exp overflowed (inf / inf would be NaN)
    return torch.where(um1 == -1, um1, corrected)


# Note [logaddexp as PyTorch computes it]
# torchlib's ``log(exp(a) + exp(b))`` overflows for a or b above 88 (float32): ``logaddexp(89, -2.5)`` was
# inf. PyTorch's kernel is ``max(a, b) + log1p(exp(-|a - b|))``, and ``a`` itself where a == b is infinite
# (inf - inf would be NaN); logaddexp2 the same in base 2. ``logcumsumexp`` (torchlib: ``log(cumsum(exp(x -
# max(x))))``, -inf wherever a value is 88 below the row's maximum, and NaN for any infinity) is a scan of
# the same step: Hillis-Steele, ``ceil(log2(n))`` rounds of ``y_i = logaddexp(y_i, y_{i - 2^k})``, each a
# shifted copy padded with -inf (the step's identity), so every output is exact to the rounding of its
# sums as PyTorch's sequential scan is (its step: ``log1p(exp(min - max)) + max``, ``x`` where both are the
# same infinity).
def _log_add_exp(a: torch.Tensor, b: torch.Tensor, base2: bool) -> torch.Tensor:
    high = torch.maximum(a, b)
    if base2:
        step = high + torch.log1p(torch.exp2(-(a - b).abs())) * _const(1 / math.log(2), a)
    else:
        step = high + torch.log1p(torch.exp(-(a - b).abs()))
    return torch.where((a == b) & torch.isinf(a), a, step)


def logaddexp(self: torch.Tensor, other: torch.Tensor) -> object:
    """``max + log1p(exp(-|a - b|))`` (Note [logaddexp as PyTorch computes it])."""
    if not _floating(self, other) or self.dtype != other.dtype:
        return NotImplemented
    return _log_add_exp(self, other, base2=False)


def logaddexp2(self: torch.Tensor, other: torch.Tensor) -> object:
    """``max + log1p(2^-|a - b|) / ln 2`` (Note [logaddexp as PyTorch computes it])."""
    if not _floating(self, other) or self.dtype != other.dtype:
        return NotImplemented
    return _log_add_exp(self, other, base2=True)


def logcumsumexp(self: torch.Tensor, dim: int) -> object:
    """A scan of logaddexp steps (Note [logaddexp as PyTorch computes it]); ``NotImplemented`` for a symbolic
    length."""
    if not _floating(self):
        return NotImplemented
    if self.dim() == 0:
        return self.clone()
    dim = dim % self.dim()
    n = self.shape[dim]
    if not isinstance(n, int):
        return NotImplemented
    out = self
    shift = 1
    while shift < n:
        # y_i and y_{i - shift}; the first ``shift`` positions meet -inf, the step's identity
        before = torch.cat([torch.full_like(out.narrow(dim, 0, shift), -math.inf), out.narrow(dim, 0, n - shift)],
                           dim)
        out = _log_add_exp(out, before, base2=False)
        shift *= 2
    return out


# Note [sigmoid in plain operators]
# onnxruntime's ``Sigmoid`` (MLAS's logistic) is an approximation that gives up in the tail: float32
# sigmoid(-10) was 2e-4 off in relative terms and sigmoid(-15) and below 0 or garbage, float64 went to 0
# below -40; so ``log(sigmoid(x))`` was -inf where PyTorch gives -20, and a BCE on sigmoid outputs hit its
# -100 clamp. PyTorch's kernel is ``1 / (1 + exp(-x))`` (and silu ``x / (1 + exp(-x))``), which
# ``Exp``, ``Add`` and ``Reciprocal``/``Div`` compute to an ulp everywhere.
def sigmoid(self: torch.Tensor) -> object:
    """``1 / (1 + exp(-x))`` (Note [sigmoid in plain operators])."""
    if not _floating(self):
        return NotImplemented
    return torch.reciprocal(torch.exp(-self) + 1)


def silu(self: torch.Tensor) -> object:
    """``x / (1 + exp(-x))`` (Note [sigmoid in plain operators])."""
    if not _floating(self):
        return NotImplemented
    return self / (torch.exp(-self) + 1)


def softplus(self: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> object:
    """PyTorch's ``x * beta > threshold ? x : log1p(exp(x * beta)) / beta``, constants exact in float64 (torchlib's
    form differed where ``x * beta`` is large but under the threshold: PyTorch's ``exp`` overflows to inf)."""
    if not _floating(self):
        return NotImplemented
    scaled = self if beta == 1 else self * _const(beta, self)
    soft = torch.log1p(torch.exp(scaled))
    if beta != 1:
        soft = soft / _const(beta, self)
    return torch.where(scaled > _const(threshold, self), self, soft)


def xlogy(self: torch.Tensor, other: torch.Tensor | float) -> object:
    """PyTorch's ``isnan(y) ? NaN : x == 0 ? 0 : x * log(y)`` (torchlib's gave 0 for ``xlogy(0, nan)``)."""
    if isinstance(other, (int, float)) and _floating(self):
        other = _const(other, self)
    if not _floating(self, other) or self.dtype != other.dtype:
        return NotImplemented
    product = torch.where(self == 0, _const(0.0, self), self * torch.log(other))
    return torch.where(torch.isnan(other), other, product)


# Note [erfc, erfcx and log_ndtr]
# ONNX has ``Erf`` only: torchlib's ``erfcx`` is ``exp(x^2) * (1 - erf(x))``, 0 from x = 5 (float32) and
# NaN from x = 30 (inf * 0); ``erfc`` is ``1 - erf(x)``, 0 wherever erfc is below float32's epsilon; and
# ``log_ndtr``, torch's ``log(ndtr(x))``, was NaN below x = -20. PyTorch computes ``erfcx`` with Steven G.
# Johnson's Faddeeva method: 100 Chebyshev polynomials of degree 6 in ``y = 400 / (4 + |x|)`` (one per
# hundredth of y), a continued fraction above x = 50, and ``2 exp(x^2) - erfcx(-x)`` below 0. Here the
# same: each polynomial's coefficients are recovered once from torch's own float64 kernel (seven points
# per interval, a 7x7 solve: the same polynomial to ~1e-16), held as a [100, 7] constant and gathered by
# interval. ``erfc(x)`` is ``1 - erf(x)`` below 0.5 and ``erfcx(x) exp(-x^2)`` above; ``log_ndtr`` follows
# PyTorch's (SciPy's) formula on top. (PyTorch's float32 ``ndtr`` is ``(1 + erf(x / sqrt 2)) / 2`` itself, 0
# below -6 as torch's decomposition is, so it stays that.)
@functools.cache
def _erfcx_table() -> np.ndarray:
    """[100, 7]: the coefficients (t^0 .. t^6) of PyTorch's ``erfcx_y100`` polynomial on ``[i, i + 1)``, recovered
    from its float64 kernel; the intervals no ``x`` reaches (y100 < 400 / 54) stay 0."""
    table = np.zeros((100, 7))
    nodes = np.cos(np.pi * (np.arange(7) + 0.5) / 7)  # Chebyshev nodes in (-1, 1)
    for i in range(7, 100):
        y100 = (nodes + 2 * i + 1) / 2
        x = 400.0 / y100 - 4.0
        values = torch.special.erfcx(torch.tensor(x, dtype=torch.float64)).numpy()
        t = 2 * (400.0 / (4.0 + x)) - (2 * i + 1)  # where the kernel evaluates it, rounding included
        table[i] = np.linalg.solve(np.vander(t, 7, increasing=True), values)
    return table


def erfcx(self: torch.Tensor) -> object:
    """PyTorch's ``erfcx`` (Note [erfc, erfcx and log_ndtr])."""
    if not _floating(self):
        return NotImplemented
    x = self
    ax = torch.where(torch.isnan(x), _const(0.0, x), x.abs())  # a NaN's index would be out of the table
    y100 = 400 / (ax + 4)
    index = torch.clamp(torch.floor(y100), 0, 99).to(torch.int64)
    t = 2 * y100 - (2 * index + 1).to(x.dtype)
    # as_tensor of the array: a constant of the graph (``torch.tensor`` of it would trace an in-place detach_)
    coefficients = torch.as_tensor(_erfcx_table(), dtype=x.dtype, device=x.device)[index]
    poly = coefficients[..., 6]
    for k in range(5, -1, -1):
        poly = poly * t + coefficients[..., k]
    # x > 50: the continued fraction PyTorch uses; above 5e7 its first term (the rest would overflow)
    isp = _const(0.56418958354775628694807945156, x)
    x2 = x * x
    fraction = isp * (x2 * (x2 + 4.5) + 2) / (x * (x2 * (x2 + 5) + 3.75))
    positive = torch.where(x > 5e7, isp / x, torch.where(x > 50, fraction, poly))
    twice = 2 * torch.exp(x2)
    negative = torch.where(x < -6.1, twice, twice - poly)
    negative = torch.where(x < -26.7, _const(math.inf, x), negative)
    result = torch.where(x >= 0, positive, negative)
    return torch.where(torch.isnan(x), x, result)


def erfc(self: torch.Tensor) -> object:
    """``1 - erf(x)`` below 0.5, ``erfcx(x) * exp(-x^2)`` above (Note [erfc, erfcx and log_ndtr])."""
    if not _floating(self):
        return NotImplemented
    tail = erfcx(self.clamp(min=0.5)) * torch.exp(-self * self)
    tail = torch.where(self == math.inf, _const(0.0, self), tail)
    return torch.where(self < 0.5, 1 - torch.erf(self), tail)


def log_ndtr(self: torch.Tensor) -> object:
    """PyTorch's ``log_ndtr``: ``log(erfcx(-t) / 2) - t^2`` below x = -1, ``log1p(-erfc(t) / 2)`` above."""
    if not _floating(self):
        return NotImplemented
    t = self * _const(math.sqrt(0.5), self)
    low = torch.log(erfcx(-t) / 2) - t * t
    high = torch.log1p(-erfc(t) / 2)
    return torch.where(self < -1, low, high)


def pow_root(self: torch.Tensor, exponent: float) -> object:
    """``x ** 0.5`` and ``x ** -0.5`` as ``sqrt`` and ``rsqrt``, as PyTorch's kernel computes them (``Pow`` gives
    ``pow(-inf, 0.5) = inf`` and ``pow(-0.0, 0.5) = +0.0``, ``sqrt`` NaN and -0.0)."""
    if not _floating(self) or not isinstance(exponent, (int, float)) or exponent not in (0.5, -0.5):
        return NotImplemented
    return torch.sqrt(self) if exponent == 0.5 else torch.rsqrt(self)


# Note [float32 variances in float64]
# PyTorch's CPU ``var``/``std`` (and ``var_mean``, ``std_mean``) accumulate float32 in float64
# (Welford in ``acc_type<float>``): the variance of finite data above 3.4e38 is inf, and its ``std``
# finite (``std([1e20, 1e20, -1e20, 3e20, 1])`` is 1.48e20). torchlib's float32 sums gave inf for the
# ``std`` too and for every variance whose squares overflow on the way. ``prims.var`` of float32 is
# computed in float64 and rounded once, as PyTorch's.
def var_float32_in_float64(self: torch.Tensor, dims: list[int] | None, correction: float = 1.0, *,
                           output_dtype: torch.dtype | None = None) -> object:
    """``prims.var`` of float32 in float64 (Note [float32 variances in float64])."""
    if self.dtype != torch.float32 or output_dtype is not None or self.numel() == 0:
        return NotImplemented
    return torch.ops.prims.var(self.double(), dims, correction).float()


def std_float32_in_float64(self: torch.Tensor, dim: object = None, *, correction: float | None = None,
                           keepdim: bool = False) -> object:
    """``std`` of float32 as ``sqrt`` of the float64 variance, rounded once (Note [float32 variances in float64])."""
    if self.dtype != torch.float32 or self.numel() == 0:
        return NotImplemented
    return torch.std(self.double(), dim, correction=correction, keepdim=keepdim).float()


def std_mean_float32_in_float64(self: torch.Tensor, dim: object = None, *, correction: float | None = None,
                                keepdim: bool = False) -> object:
    """``std_mean`` of float32: the ``std`` in float64 (Note [float32 variances in float64]), the mean as before."""
    if self.dtype != torch.float32 or self.numel() == 0:
        return NotImplemented
    std = torch.std(self.double(), dim, correction=correction, keepdim=keepdim).float()
    return std, torch.mean(self, dim if dim is not None else [], keepdim=keepdim)


# Note [Average pooling's divisor_override]
# torchlib's ``avg_pool2d``/``avg_pool3d`` drop ``divisor_override``: every window was divided by its own
# size (1.0 where PyTorch gives 4/3). The pool is traced without the override and multiplied by each
# window's count (PyTorch's, with the padding counted, which the pool divided by) over the override;
# the backward (``avg_pool2d_backward``, ortlab's decomposition) divides by the override already.
def avg_pool_divisor_override(spatial: int) -> Callable[..., object]:
    """``avg_pool{spatial}d`` with ``divisor_override`` (Note [Average pooling's divisor_override])."""

    def avg_pool(self: torch.Tensor, kernel_size: list[int], stride: list[int] | None = None,
                 padding: list[int] | int = 0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None) -> object:
        if not divisor_override or not _floating(self):
            return NotImplemented
        if any(not isinstance(n, int) for n in self.shape[-spatial:]):
            return NotImplemented
        kernel = _expand(kernel_size, spatial)
        step = _expand(stride, spatial) if stride else kernel
        pad = _expand(padding, spatial)
        pool = torch.nn.functional.avg_pool2d if spatial == 2 else torch.nn.functional.avg_pool3d
        pooled = pool(self, kernel, step, pad, ceil_mode, True)
        counts = None
        for d in range(spatial):
            n_in, n_out = self.shape[-spatial + d], pooled.shape[-spatial + d]
            start = torch.arange(n_out, device=self.device) * step[d] - pad[d]
            size = (torch.clamp(start + kernel[d], max=n_in + pad[d]) - start).reshape([-1] + [1] * (spatial - 1 - d))
            counts = size if counts is None else counts * size
        return pooled * (counts.to(self.dtype) / divisor_override)

    return avg_pool


def _expand(values: list[int] | int, spatial: int) -> list[int]:
    values = [values] if isinstance(values, int) else list(values)
    return values * spatial if len(values) == 1 else values


def float_edge_decompositions() -> dict[OpOverload, Callable]:
    """This module's decompositions, by the op each is traced for."""
    _erfcx_table()  # from torch's kernel, now: inside a trace its erfcx would be this module's
    table: dict[OpOverload, Callable] = {
        aten.hardtanh_backward.default: hardtanh_backward,
        aten.hardswish_backward.default: hardswish_backward,
        aten.hardsigmoid_backward.default: hardsigmoid_backward,
        aten.elu_backward.default: elu_backward,
        aten.celu.default: celu,
        aten.softshrink.default: softshrink,
        aten.clamp_min.default: clamp_min,
        aten.clamp_max.default: clamp_max,
        aten.clamp.default: clamp,
        aten.sign.default: sign,
        aten.sgn.default: sign,
        aten.trunc.default: trunc,
        aten.frac.default: frac,
        aten.heaviside.default: heaviside,
        aten.atan2.default: atan2,
        aten.elu.default: elu,
        aten._prelu_kernel.default: prelu_kernel,
        aten._prelu_kernel_backward.default: prelu_kernel_backward,
        aten.leaky_relu_backward.default: leaky_relu_backward,
        aten.angle.default: angle,
        aten.remainder.Tensor: remainder,
        aten.remainder.Scalar: remainder,
        aten.div.Tensor_mode: div_mode,
        aten.div.Scalar_mode: div_mode,
        aten.floor_divide.default: floor_divide,
        aten.linalg_vector_norm.default: vector_norm_inf,
        aten._log_softmax.default: log_softmax_float64,
        aten.logaddexp.default: logaddexp,
        aten.logaddexp2.default: logaddexp2,
        aten.logcumsumexp.default: logcumsumexp,
        aten.log1p.default: log1p,
        aten.expm1.default: expm1,
        aten.sigmoid.default: sigmoid,
        aten.silu.default: silu,
        aten.softplus.default: softplus,
        aten.xlogy.Tensor: xlogy,
        aten.xlogy.Scalar_Other: xlogy,
        aten.special_erfcx.default: erfcx,
        aten.erfc.default: erfc,
        aten.special_log_ndtr.default: log_ndtr,
        aten.pow.Tensor_Scalar: pow_root,
        torch.ops.prims.var.default: var_float32_in_float64,
        aten.std.correction: std_float32_in_float64,
        aten.std_mean.correction: std_mean_float32_in_float64,
        aten.avg_pool2d.default: avg_pool_divisor_override(2),
        aten.avg_pool3d.default: avg_pool_divisor_override(3),
    }
    return table


# Note [An even split of the gradient as the CPU kernel writes it]
# The gradient of ``max()``, ``min()``, ``median()`` and ``nanmedian()`` over all elements is PyTorch's
# ``evenly_distribute_backward``: the incoming gradient divided evenly among the elements equal to the
# result. Its C++ has two branches: on the CPU, ``zeros.masked_fill_(mask, g / count)`` (+0.0 elsewhere);
# for CUDA and tensor subclasses, ``mask * (g / count)``. AOTAutograd traces with subclasses (fake
# tensors), so its graph holds the product, whose zeros carry the gradient's sign: a negative gradient gave
# -0.0 at 124 of 125 elements where eager on the CPU gives +0.0. In a graph on the CPU, that product
# (recognized by its mask, ``eq(x, v) | (isnan(x) & isnan(v))``) becomes the select the CPU kernel makes.
def even_splits_as_on_cpu(gm: torch.fx.GraphModule) -> int:
    """Rewrite the products of ``evenly_distribute_backward`` in ``gm`` as the CPU kernel's select (Note [An even
    split of the gradient as the CPU kernel writes it]); returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.mul.Tensor or len(node.args) != 2:
            continue
        mask, share = node.args
        if not (isinstance(mask, torch.fx.Node) and _is_even_split_mask(mask)):
            continue
        with gm.graph.inserting_before(node):
            select = gm.graph.call_function(aten.where.self, (mask, share, 0.0))
        select.meta = dict(node.meta)
        node.replace_all_uses_with(select)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def _is_even_split_mask(mask: torch.fx.Node) -> bool:
    """``logical_or(eq(x, v), logical_and(isnan(x), isnan(v)))``, evenly_distribute_backward's mask."""
    if mask.target is not aten.logical_or.default or len(mask.args) != 2:
        return False
    eq, both_nan = mask.args
    if not (isinstance(eq, torch.fx.Node) and isinstance(both_nan, torch.fx.Node)):
        return False
    if eq.target is not aten.eq.Tensor or both_nan.target is not aten.logical_and.default:
        return False
    nans = both_nan.args
    return (len(nans) == 2 and all(isinstance(n, torch.fx.Node) and n.target is aten.isnan.default for n in nans)
            and [n.args[0] for n in nans] == list(eq.args))
