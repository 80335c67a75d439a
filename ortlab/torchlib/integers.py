"""Exact ONNX translations of integer arithmetic that torchlib computes through floats (or worse).

Note [Integer arithmetic stays integer]
PyTorch computes integer ops in their own dtype: exactly, wrapping around on overflow (two's
complement). torchlib's translations and onnxruntime's kernels do not always:

* ``torch.div(a, b, rounding_mode="trunc"|"floor")`` on integers was ``Div`` of the operands cast to
  float32: ``div(123456789, 10, "trunc")`` gave 12345679, int32 ``2**31 - 1`` divided by 1 gave
  ``-2**31``.
* onnxruntime's ``ReduceSum`` and ``ReduceProd`` of int64 round through float64 and saturate:
  ``[2**53, 1].sum()`` was 2**53, ``[3**20, 3**15].prod()`` off by 3, an overflowing product (and so
  ``cumprod``, whose decomposition multiplies with ``prod``) ``2**63 - 1`` where PyTorch wraps.
* onnxruntime's integer ``Pow`` goes through ``std::pow`` in float64: ``3 ** 35`` off by 3, ``3 ** 40``
  saturated.
* integer ``Div`` and ``Mod`` by zero stop the run with onnxruntime's own error, and ``Div`` of the
  smallest integer by -1 (``-2**63 // -1``, which PyTorch answers with ``-2**63``) can kill the process
  with SIGFPE (a one-element ``Div`` did).
* ``any`` over no elements was True: ``ReduceMax`` of an empty int64 tensor is ``-2**63``, which casts
  to True.

So for integer operands:

* division, ``floor_divide``, ``remainder`` and ``fmod`` are integer ``Div``/``Mod`` with a divisor
  that is never 0 or -1 (a 0 becomes 1, and the guard of the op raises PyTorch's
  ``ZeroDivisionError`` after the run: Note [Value guards] in ``ortlab.onnx.guards``; ``x / -1`` is
  ``-x``, which wraps as PyTorch does); flooring corrects the truncated quotient where the C-style
  remainder is nonzero and its sign differs from the divisor's. int8, int16 and uint8 compute in
  int32 (onnxruntime has no int16 ``Where``) and cast back, which wraps as PyTorch does.
* ``sum`` is a ``MatMul`` by a column of ones over the reduced elements moved last: onnxruntime's
  integer GEMM adds in int64 (int32) and wraps (checked against Python's integers at 2**62 and
  over 300,000 elements).
* ``prod`` multiplies halves pairwise (``ceil(log2 n)`` ``Mul``s over a static size ``n``), each
  product in int64, wrapping; a size known only at run time runs in PyTorch
  (``ortlab.placement.KNOWN_WRONG``).
* ``pow`` with a Python integer exponent is square-and-multiply, ``2 * log2(e)`` ``Mul``s at most.
  A tensor exponent runs in PyTorch (placement).
* ``any`` reduces as uint8, whose empty maximum is 0.
* ``diagonal`` (and ``trace``, its sum) of integers gathers the diagonal by index: torchlib's multiplies
  by an identity mask and adds each row with ``ReduceSum``, so a diagonal entry above 2**53 came back
  rounded. Integer ``addbmm`` is one ``MatMul`` over the batch folded into the inner dim (torchlib's
  ``ReduceSum`` of the batch's products). ``isnan`` of an integer is False (``nansum``'s decomposition asks;
  onnxruntime's IsNaN has no integer kernels).

Float operands keep torchlib's translations: nothing here is on a float path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

__all__ = ["register", "static_reduced_size"]

_INT64 = ir.DataType.INT64
# Integer dtypes onnxruntime's kernels of the division's ops do not all cover (int16 Where): computed in int32.
_WIDENED = (ir.DataType.INT8, ir.DataType.INT16, ir.DataType.UINT8)


def _is_integer(x: object) -> bool:
    """An integer (not bool) tensor value, or a Python int."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and dtype.is_integer()


def _constant(value: int, dtype: ir.DataType):  # noqa: ANN202
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


def _as_value(x, dtype: ir.DataType):  # noqa: ANN001, ANN202
    """``x`` as an ONNX value of ``dtype`` (a Python number becomes a constant of it)."""
    if isinstance(x, (int, float)):
        return _constant(int(x), dtype)
    return x if x.dtype == dtype else op.Cast(x, to=dtype)


# ----------------------------------------------------------------------------------- division
def _integer_division(a, b, mode: str, dtype: ir.DataType):  # noqa: ANN001, ANN202
    """``a`` divided by ``b`` (integer values of ``dtype``) exactly: ``mode`` is ``trunc``, ``floor``,
    ``remainder`` (Python's sign) or ``fmod`` (C's sign). A zero divisor divides by 1 (its guard raises)."""
    work = ir.DataType.INT32 if dtype in _WIDENED else dtype  # (a traced value's dtype is not known after a Cast)
    if dtype in _WIDENED:
        a, b = op.Cast(a, to=work), op.Cast(b, to=work)
    zero, one = _constant(0, work), _constant(1, work)
    signed = work.is_signed()
    minus_one = op.Equal(b, _constant(-1, work)) if signed else None
    unsafe = op.Equal(b, zero)
    if minus_one is not None:
        unsafe = op.Or(unsafe, minus_one)
    safe = op.Where(unsafe, one, b)
    if mode in ("trunc", "floor"):
        result = op.Div(a, safe)
        if minus_one is not None:
            result = op.Where(minus_one, op.Neg(a), result)
            if mode == "floor":
                rest = op.Mod(a, safe, fmod=1)  # the sign of a
                differ = op.Xor(op.Less(rest, zero), op.Less(safe, zero))
                result = op.Sub(result, op.Cast(op.And(op.Not(op.Equal(rest, zero)), differ), to=work))
    else:  # x % 1 == x % -1 == 0: the safe divisor changes no remainder
        result = op.Mod(a, safe, fmod=1 if mode == "fmod" else 0)
    return op.Cast(result, to=dtype) if dtype in _WIDENED else result


def _divide(torchlib_fn, mode: str | None = None):  # noqa: ANN001, ANN202
    """A translation of a dividing op taking ``(self, other)``: exact for integers, torchlib's otherwise."""

    def divide(self, other, rounding_mode: str | None = None):  # noqa: ANN001, ANN202
        how = mode or rounding_mode
        if how is None or not (_is_integer(self) and _is_integer(other)):
            args = (self, other) if mode is not None else (self, other, rounding_mode)
            return torchlib_fn(*args)
        dtype = self.dtype if not isinstance(self, int) else other.dtype
        return _integer_division(_as_value(self, dtype), _as_value(other, dtype), how, dtype)

    return divide


# ----------------------------------------------------------------------------------- reductions
def _reduced_axes(rank: int, dim: Sequence[int] | int | None) -> list[int]:
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % rank for d in dims})


def static_reduced_size(shape: Sequence[object], dim: Sequence[int] | int | None) -> int | None:
    """The number of elements a reduction over ``dim`` of ``shape`` combines, None where a size is symbolic.

    Example:
        >>> static_reduced_size((2, 3, 4), [0, 2])
        8
    """
    if len(shape) == 0:
        return 1
    sizes = [shape[d] for d in _reduced_axes(len(shape), dim)]
    if not all(isinstance(n, int) for n in sizes):
        return None
    return int(np.prod(sizes, dtype=np.int64)) if sizes else 1


def _rows(x, rank: int, axes: list[int]):  # noqa: ANN001, ANN202
    """``x`` (of rank ``rank >= 1``) with the ``axes`` moved last and flattened into one: ``[kept..., n]``; the
    kept dims' sizes (a 1-D int64 value, or None when every axis is reduced); and ``n`` (``[n]``)."""
    kept = [d for d in range(rank) if d not in axes]
    perm = kept + axes
    moved = op.Transpose(x, perm=perm) if perm != list(range(rank)) else x
    shape = op.Shape(x)
    count = op.ReduceProd(op.Gather(shape, op.Constant(value_ints=axes)), keepdims=1)  # sizes: far below 2**53
    kept_shape = op.Gather(shape, op.Constant(value_ints=kept)) if kept else None
    rows_shape = op.Concat(kept_shape, count, axis=0) if kept else count
    return op.Reshape(moved, rows_shape, allowzero=1), kept_shape, count  # (a 0 in the shape is a size)


def _reshaped(result, kept_shape, axes: list[int], keepdim: bool):  # noqa: ANN001, ANN202
    """``result`` (``[kept..., 1]`` or ``[1]``) in the reduction's output shape."""
    out = op.Reshape(result, kept_shape if kept_shape is not None else op.Constant(value_ints=[]), allowzero=1)
    return op.Unsqueeze(out, op.Constant(value_ints=axes)) if keepdim else out


def _integer_sum(self, dim: Sequence[int] | int | None, keepdim: bool, dtype: ir.DataType):  # noqa: ANN001, ANN202
    """The sum of an integer (or bool) tensor over ``dim`` in int64, wrapping, cast to ``dtype``."""
    x = op.Cast(self, to=_INT64) if self.dtype != _INT64 else self
    rank = len(self.shape)
    if rank == 0:
        total = op.Identity(x)
    else:
        axes = _reduced_axes(rank, dim)
        rows, kept_shape, count = _rows(x, rank, axes)
        ones = op.ConstantOfShape(op.Concat(count, op.Constant(value_ints=[1]), axis=0),
                                  value=ir.tensor(np.array([1], dtype=np.int64)))
        total = _reshaped(op.MatMul(rows, ones), kept_shape, axes, keepdim)
    return op.Cast(total, to=dtype) if dtype != _INT64 else total


def _tree_product(rows, rank: int, n: int):  # noqa: ANN001, ANN202
    """The product of int64 ``rows``' (of rank ``rank``) last axis of static size ``n >= 1``, multiplying
    halves pairwise; the last axis stays, of size 1."""
    axis = op.Constant(value_ints=[-1])
    while n > 1:
        if n % 2:  # one more factor of 1
            pads = [0] * rank + [0] * (rank - 1) + [1]
            rows = op.Pad(rows, op.Constant(value_ints=pads), _constant(1, _INT64))
            n += 1
        half = n // 2
        low = op.Slice(rows, op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), axis)
        high = op.Slice(rows, op.Constant(value_ints=[half]), op.Constant(value_ints=[n]), axis)
        rows, n = op.Mul(low, high), half
    return rows


def _integer_prod(self, dim: Sequence[int] | int | None, keepdim: bool, dtype: ir.DataType):  # noqa: ANN001, ANN202
    """The product of an integer (or bool) tensor over ``dim`` in int64, wrapping, cast to ``dtype``."""
    x = op.Cast(self, to=_INT64) if self.dtype != _INT64 else self
    rank = len(self.shape)
    if rank == 0:
        return op.Cast(x, to=dtype) if dtype != _INT64 else op.Identity(x)
    axes = _reduced_axes(rank, dim)
    n = static_reduced_size(self.shape, axes)
    if n is None:  # placement runs these in PyTorch; reaching here is ortlab's bug
        raise ValueError("an integer prod over a size known only at run time has no exact translation")
    rows, kept_shape, _ = _rows(x, rank, axes)
    if n == 0:
        ones_shape = op.Concat(kept_shape, op.Constant(value_ints=[1]), axis=0) if kept_shape is not None \
            else op.Constant(value_ints=[1])
        product = op.ConstantOfShape(ones_shape, value=ir.tensor(np.array([1], dtype=np.int64)))
    else:
        product = _tree_product(rows, rank - len(axes) + 1, n)
    total = _reshaped(product, kept_shape, axes, keepdim)
    return op.Cast(total, to=dtype) if dtype != _INT64 else total


def _result_dtype(self, dtype: int | None) -> ir.DataType | None:  # noqa: ANN001
    """The integer dtype an integer sum or product returns (int64, or ``dtype``), None for float results."""
    if dtype is not None and dtype != -1:
        wanted = ir.DataType(dtype)
        return wanted if wanted.is_integer() and (self.dtype.is_integer() or self.dtype == ir.DataType.BOOL) else None
    return _INT64 if self.dtype.is_integer() or self.dtype == ir.DataType.BOOL else None


def _reduction(integer_fn, torchlib_all, torchlib_dim, float_fn=None):  # noqa: ANN001, ANN202
    """A reduction's translations: ``integer_fn`` for integer results, torchlib's (then ``float_fn``) for the rest."""
    finish = float_fn or (lambda x, self, dtype: x)

    def reduce_all(self, dtype: int | None = None):  # noqa: ANN001, ANN202
        out = _result_dtype(self, dtype)
        if out is None:
            return finish(torchlib_all(self, dtype=-1 if dtype is None else dtype), self, dtype)
        return integer_fn(self, None, False, out)

    def reduce_dim(self, dim=None, keepdim: bool = False, dtype: int | None = None):  # noqa: ANN001, ANN202
        out = _result_dtype(self, dtype)
        if out is None:
            return finish(torchlib_dim(self, dim, keepdim, dtype=-1 if dtype is None else dtype), self, dtype)
        return integer_fn(self, dim, keepdim, out)

    return reduce_all, reduce_dim


# ----------------------------------------------------------------------------------- powers
def _pow_tensor_scalar(torchlib_fn):  # noqa: ANN001, ANN202
    def pow_(self, exponent):  # noqa: ANN001, ANN202
        if not (_is_integer(self) and isinstance(exponent, int) and not isinstance(exponent, bool)) or exponent < 0:
            return torchlib_fn(self, exponent)  # (a negative integer exponent raises in PyTorch before export)
        result, base, e = None, self, exponent
        while e:
            if e & 1:
                result = base if result is None else op.Mul(result, base)
            e >>= 1
            if e:
                base = op.Mul(base, base)
        if result is None:  # x ** 0
            return op.Expand(_constant(1, self.dtype), op.Shape(self))
        return op.Identity(result) if result is self else result

    return pow_


# ----------------------------------------------------------------------------------- diagonals, batched products
def _diagonal(torchlib_fn):  # noqa: ANN001, ANN202
    def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1):  # noqa: ANN001, ANN202
        """The diagonal by index (torchlib's multiplies by an identity mask and sums the rows: ReduceSum)."""
        if self.dtype.is_floating_point() or len(self.shape) < 2:
            return torchlib_fn(self, offset, dim1, dim2)
        rank = len(self.shape)
        dim1, dim2 = dim1 % rank, dim2 % rank
        perm = [d for d in range(rank) if d not in (dim1, dim2)] + [dim1, dim2]
        moved = op.Transpose(self, perm=perm) if perm != list(range(rank)) else self
        rows = op.Shape(moved, start=rank - 2, end=rank - 1)
        cols = op.Shape(moved, start=rank - 1)
        flat_shape = op.Concat(op.Shape(moved, start=0, end=rank - 2), op.Mul(rows, cols), axis=0) \
            if rank > 2 else op.Mul(rows, cols)
        flat = op.Reshape(moved, flat_shape, allowzero=1)
        first_row, first_col = max(-offset, 0), max(offset, 0)
        length = op.Max(op.Min(op.Sub(rows, _constant(first_row, _INT64)), op.Sub(cols, _constant(first_col, _INT64))),
                        _constant(0, _INT64))
        j = op.Range(_constant(0, _INT64), op.Squeeze(length), _constant(1, _INT64))
        index = op.Add(op.Mul(op.Add(j, _constant(first_row, _INT64)), op.Squeeze(cols)),
                       op.Add(j, _constant(first_col, _INT64)))
        return op.Gather(flat, index, axis=rank - 2)

    return diagonal


def _addbmm(torchlib_fn):  # noqa: ANN001, ANN202
    def addbmm(self, batch1, batch2, beta: float = 1.0, alpha: float = 1.0):  # noqa: ANN001, ANN202
        """Integer ``addbmm`` as one MatMul over the batch folded into the inner dim (torchlib's ReduceSum
        adds the batch's products in float64)."""
        if not (_is_integer(self) and _is_integer(batch1)):
            return torchlib_fn(self, batch1, batch2, beta=beta, alpha=alpha)
        inner = op.Mul(op.Shape(batch1, start=0, end=1), op.Shape(batch1, start=2, end=3))
        left = op.Reshape(op.Transpose(batch1, perm=[1, 0, 2]),
                          op.Concat(op.Shape(batch1, start=1, end=2), inner, axis=0), allowzero=1)
        right = op.Reshape(batch2, op.Concat(inner, op.Shape(batch2, start=2, end=3), axis=0), allowzero=1)
        product = op.MatMul(left, right)
        if alpha != 1:
            product = op.Mul(product, _constant(int(alpha), self.dtype))
        if beta == 0:  # self is ignored, as PyTorch does
            return op.Identity(product)
        return op.Add(product, self if beta == 1 else op.Mul(self, _constant(int(beta), self.dtype)))

    return addbmm


# ----------------------------------------------------------------------------------- isnan
def _isnan(torchlib_fn):  # noqa: ANN001, ANN202
    def isnan(self):  # noqa: ANN001, ANN202
        """No integer is NaN (``nansum``'s decomposition asks; onnxruntime's IsNaN has no integer kernels)."""
        if self.dtype.is_floating_point():
            return torchlib_fn(self)
        return op.Expand(op.Constant(value=ir.tensor(np.array(False))), op.Shape(self))

    return isnan


# ----------------------------------------------------------------------------------- any
def _any(self, dim=None, keepdim: bool = False):  # noqa: ANN001, ANN202
    """``any`` as a uint8 maximum, 0 over no elements (int64's is -2**63, which casts to True)."""
    flags = op.Cast(op.Cast(self, to=ir.DataType.BOOL), to=ir.DataType.UINT8)
    if len(self.shape) == 0:
        return op.Cast(flags, to=ir.DataType.BOOL)
    axes = _reduced_axes(len(self.shape), dim)
    return op.Cast(op.ReduceMax(flags, op.Constant(value_ints=axes), keepdims=keepdim), to=ir.DataType.BOOL)


def register(registry: object) -> None:
    """Add the exact integer translations to a torchlib registry (Note [Integer arithmetic stays integer])."""
    from onnxscript.function_libs.torch_lib.ops import core

    aten = torch.ops.aten
    translations = {
        aten.div.Tensor_mode: _divide(core.aten_div_mode),
        aten.div.Scalar_mode: _divide(core.aten_div_mode),
        aten.floor_divide.default: _divide(core.aten_floor_divide, "floor"),
        aten.remainder.Tensor: _divide(core.aten_remainder, "remainder"),
        aten.remainder.Scalar: _divide(core.aten_remainder_scalar, "remainder"),
        aten.remainder.Scalar_Tensor: _divide(core.aten_remainder_scalar_tensor, "remainder"),
        aten.fmod.Tensor: _divide(core.aten_fmod, "fmod"),
        aten.fmod.Scalar: _divide(core.aten_fmod, "fmod"),
        aten.pow.Tensor_Scalar: _pow_tensor_scalar(core.aten_pow_tensor_scalar),
        aten.any.default: _any,
        aten.any.dim: _any,
        aten.any.dims: _any,
        aten.diagonal.default: _diagonal(core.aten_diagonal),
        aten.diagonal_copy.default: _diagonal(core.aten_diagonal),
        aten.addbmm.default: _addbmm(core.aten_addbmm),
        aten.isnan.default: _isnan(core.aten_isnan),
    }
    from ortlab.torchlib.float_edges import plus_zero

    sum_all, sum_dim = _reduction(_integer_sum, core.aten_sum, core.aten_sum_dim_IntList, plus_zero)
    translations[aten.sum.default], translations[aten.sum.dim_IntList] = sum_all, sum_dim

    def torchlib_prod_dim(self, dim, keepdim: bool = False, dtype: int = -1):  # noqa: ANN001, ANN202
        if self.shape is not None and len(self.shape) == 0:  # onnxruntime rejects ReduceProd of a 0-d tensor
            return op.Identity(self) if dtype in (-1, None) else op.Cast(self, to=dtype)
        return core.aten_prod_dim_int(self, dim, keepdim, dtype=dtype)

    prod_all, prod_dim = _reduction(_integer_prod, core.aten_prod, torchlib_prod_dim)
    translations[aten.prod.default], translations[aten.prod.dim_int] = prod_all, prod_dim
    if hasattr(aten.floor_divide, "Scalar"):
        translations[aten.floor_divide.Scalar] = _divide(core.aten_floor_divide, "floor")
    for target, fn in translations.items():
        registry.register_op(target, fn)  # type: ignore[attr-defined]
