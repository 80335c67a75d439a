"""ONNX translations ortlab adds to torchlib's registry, each for a real gap.

Maximum and minimum with NaN (``amax``, ``amin``, ``max``/``min`` over all or one dim with
their indices, ``argmax``, ``argmin``): PyTorch propagates NaN (the result is NaN and
the index is the first NaN's), onnxruntime's ReduceMax/ArgMax skip it: on
``[1, nan, -2, .5]`` ``amax`` was 1.0 through onnxruntime. These translations take the
reduction as torchlib does and replace the result where the reduced values hold a NaN
(``IsNaN``, one more reduction and a ``Where``; integer tensors keep torchlib's form). Bool and int16
tensors, for which onnxruntime has no ArgMax/ReduceMax kernels, reduce as int32.

Max pools (``max_pool2d``/``max_pool3d`` with their indices, which every training graph and
AOTAutograd's no-grad graphs use): ONNX ``MaxPool`` skips NaN too, on the CPU provider and on
OpenVINO; a window holding one came out as the largest number beside it where PyTorch gives NaN.
The translation takes torchlib's pool and puts NaN where a ``MaxPool`` of the input's NaN flags
finds one, and its index where PyTorch's is, the window's last NaN (the gradient goes there, as in eager).

``index_put(..., accumulate=True)`` (an embedding's backward): torchlib emits
``ScatterND(reduction="add")``, which onnxruntime's CPU provider runs in parallel
and loses updates when indices repeat (gradients off by 10-30 on repeated tokens,
different on every run). ``ScatterElements(reduction="add")`` over the flattened
indices gives the exact sums, deterministically (checked against ``np.add.at``).
Only the embedding form (one index tensor on dim 0) is translated; other forms stay
in PyTorch with that reason (see ``ortlab.placement.KNOWN_WRONG``). A plain ``index_put``
(``x[idx] = v``, ``index_copy``) writes: it is torchlib's translation (until 2026-11-27 it
went through this one and added, silently, wherever ``x`` was not zeros).

``scalar_tensor`` (every Python number the exporter's type promotion turns into a tensor:
``x * 0.3``, ``x + eps``, the constants of ``gelu``/``erf``/``var`` backward): torchlib
emits ``Cast(Constant(float32))``, so a float64 model computed with float32 constants
(``x * 0.3`` off by 2.8e-8, a 1e-8 error in float64 MultiheadAttention gradients, 40 of
60 float64 ops probed). The translation makes the constant in the target dtype directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import math

import onnx_ir as ir
import torch
from onnxscript import opset18 as op

__all__ = ["register", "is_single_index_accumulate", "scalar_tensor", "slice_tensor"]


def is_single_index_accumulate(node: torch.fx.Node) -> bool:
    """``index_put(self, [idx], values, accumulate=True)`` with one index on dim 0."""
    indices = node.args[1] if len(node.args) > 1 else None
    return isinstance(indices, (list, tuple)) and len(indices) == 1 and indices[0] is not None


def index_put_accumulate(self, indices: Sequence, values, accumulate: bool = False):  # noqa: ANN001
    """Scatter-add ``values`` into ``self`` at ``indices[0]`` along dim 0; a plain ``index_put`` (no
    ``accumulate``: ``x[idx] = v``) is torchlib's, which writes instead of adding, and so is a bool mask's (its
    positions are distinct: ScatterND's sum has no race; its ScatterElements took the mask for positions, which
    onnxruntime refused)."""
    if not accumulate or indices[0].dtype == ir.DataType.BOOL:
        from onnxscript.function_libs.torch_lib.ops.core import aten_index_put

        return aten_index_put(self, indices, values, accumulate=accumulate)
    (index,) = indices
    flat_index = op.Reshape(index, op.Constant(value_ints=[-1]))
    row = op.Shape(self, start=1)  # the trailing dims of one row of self
    flat_values = op.Reshape(values, op.Concat(op.Constant(value_ints=[-1]), row, axis=0))
    rank = len(self.shape) if self.shape is not None else 2
    expanded = op.Expand(
        op.Unsqueeze(flat_index, op.Constant(value_ints=list(range(1, rank)))) if rank > 1 else flat_index,
        op.Shape(flat_values),
    )
    return op.ScatterElements(self, expanded, flat_values, axis=0, reduction="add")


# ----------------------------------------------------------------------- exact constants
def scalar_tensor(s, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False):  # noqa: ANN001, ANN201
    """``s`` as a 0-d tensor of ``dtype`` (float32 when unset, as PyTorch's default)."""
    to = ir.DataType.FLOAT if dtype == -1 else ir.DataType(dtype)
    if isinstance(s, (bool, int, float)) and (to.is_floating_point() or to.is_integer() or to == ir.DataType.BOOL):
        return op.Constant(value=ir.tensor(s, dtype=to))
    return op.Cast(s, to=to)  # a symbolic size, or a complex dtype: torchlib's path


# ----------------------------------------------------------------------- NaN in max and min
def _floating(x) -> bool:  # noqa: ANN001
    return x.dtype is not None and x.dtype.is_floating_point()


def _axes(dim: Sequence[int] | int | None):  # noqa: ANN202
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return None  # Reduce* reduce every axis without one
    return op.Constant(value_ints=[dim] if isinstance(dim, int) else list(dim))


def _nan_flags(self):  # noqa: ANN001, ANN202
    return op.Cast(op.IsNaN(self), to=ir.DataType.INT32)


def _with_nan(self, value, axes, keepdim: bool):  # noqa: ANN001, ANN202
    """``value`` (a max or min of ``self``), NaN where the reduced values hold one."""
    has_nan = op.Cast(op.ReduceMax(_nan_flags(self), axes, keepdims=keepdim), to=ir.DataType.BOOL)
    return op.Where(has_nan, op.CastLike(op.Constant(value_float=math.nan), value), value)


# onnxruntime's CPU provider has no ArgMax/ArgMin/ReduceMax/ReduceMin for bool or int16 (a ``max(dim)`` over a
# bool mask is in every ``cumprod`` gradient, finding each row's first zero): those reduce as int32, which holds
# them exactly, and the values come back in their dtype.
_NO_KERNEL = (ir.DataType.BOOL, ir.DataType.INT16)


def _as_int32(x):  # noqa: ANN001, ANN202
    return op.Cast(x, to=ir.DataType.INT32) if x.dtype in _NO_KERNEL else x


def _reduce(reduce_op):  # noqa: ANN001, ANN202
    def reduce(self, dim: Sequence[int] = (), keepdim: bool = False):  # noqa: ANN001, ANN202
        axes = None if len(self.shape) == 0 else _axes(dim)  # a scalar reduces to itself
        if self.dtype in _NO_KERNEL:
            return op.Cast(reduce_op(_as_int32(self), axes, keepdims=keepdim), to=self.dtype)
        value = reduce_op(self, axes, keepdims=keepdim)
        return _with_nan(self, value, axes, keepdim) if _floating(self) else value

    return reduce


def _reduce_all(reduce_op):  # noqa: ANN001, ANN202
    def reduce_all(self):  # noqa: ANN001, ANN202
        return _reduce(reduce_op)(self, (), False)

    return reduce_all


def _arg(arg_op):  # noqa: ANN001, ANN202
    def arg(self, dim: int | None = None, keepdim: bool = False):  # noqa: ANN001, ANN202
        scalar = len(self.shape) == 0
        rank, floating = len(self.shape), _floating(self)
        self = _as_int32(self)
        if dim is None or scalar:
            self = op.Reshape(self, op.Constant(value_ints=[-1]))
        axis = 0 if dim is None or scalar else dim
        index = arg_op(self, axis=axis, keepdims=keepdim)
        if floating:  # the first NaN, as PyTorch
            flags = _nan_flags(self)
            has_nan = op.Cast(op.ReduceMax(flags, op.Constant(value_ints=[axis]), keepdims=keepdim),
                              to=ir.DataType.BOOL)
            index = op.Where(has_nan, op.ArgMax(flags, axis=axis, keepdims=keepdim), index)
        if scalar:
            return op.Squeeze(index)
        if dim is None and keepdim:
            return op.Reshape(index, op.Constant(value_ints=[1] * rank))
        return index

    return arg


def _with_index(reduce_op, arg_op):  # noqa: ANN001, ANN202
    def both(self, dim: int, keepdim: bool = False):  # noqa: ANN001, ANN202
        return _reduce(reduce_op)(self, [dim], keepdim), _arg(arg_op)(self, dim, keepdim)

    return both


def _pool_with_nan(torchlib_pool, spatial: int):  # noqa: ANN001, ANN202
    """torchlib's ``max_pool{spatial}d_with_indices``, its values NaN where the window holds a NaN."""

    def expand(values: Sequence[int] | int) -> list[int]:
        values = [values] if isinstance(values, int) else list(values)
        return values * spatial if len(values) == 1 else values

    def pool(self, kernel_size: Sequence[int], stride: Sequence[int] = (),  # noqa: ANN001, ANN202
             padding: Sequence[int] = (0,) * spatial, dilation: Sequence[int] = (1,) * spatial, ceil_mode: bool = False):
        values, indices = torchlib_pool.func(self, kernel_size, stride, padding, dilation, ceil_mode)
        if not _floating(self):
            return values, indices
        # MaxPool's attributes as torchlib writes them (stride [] is the kernel; pads at both ends)
        kernel_shape, dilations = expand(kernel_size), expand(dilation)
        strides = expand(stride) if stride else kernel_shape
        pads = expand(padding)
        pads = pads * 2 if len(pads) == spatial else pads
        # Note [A max pool's NaN and its index]: each NaN marked by its place in the plane plus one (0 elsewhere); the
        # window's largest mark is its last NaN in raster order, PyTorch's choice (its kernel takes
        # ``val > max || isnan(val)``), and the gradient goes there as in eager. The marks are float32, exact up to
        # 2**24 places, where the plane's size is known to be no more (the MaxPool runs on as many floats as the
        # pooled input: float64 cost 20-40% of a ResNet stem's pool step); float64 (2**53) otherwise.
        known = [d for d in self.shape[-spatial:] if isinstance(d, int)] if self.shape is not None else []
        small = len(known) == spatial and math.prod(known) < 2**24
        kind = ir.DataType.FLOAT if small else ir.DataType.DOUBLE
        plane = op.Shape(self, start=-spatial)
        count = op.Cast(op.ReduceProd(plane, keepdims=0), to=kind)
        one = op.Constant(value=ir.tensor(1.0, dtype=kind))
        places = op.Reshape(op.Range(one, op.Add(count, one), one), plane)
        marks = op.Mul(op.Cast(op.IsNaN(self), to=kind), places)
        unbatched = len(self.shape) == spatial + 1
        if unbatched:
            marks = op.Unsqueeze(marks, op.Constant(value_ints=[0]))
        found, _ = op.MaxPool(marks, ceil_mode=ceil_mode, dilations=dilations, kernel_shape=kernel_shape, pads=pads,
                              strides=strides)  # (onnxscript's optimizer drops the unused indices)
        if unbatched:
            found = op.Squeeze(found, op.Constant(value_ints=[0]))
        has_nan = op.Greater(found, op.Constant(value=ir.tensor(0.0, dtype=kind)))
        last_nan = op.Cast(op.Sub(found, one), to=ir.DataType.INT64)
        return (op.Where(has_nan, op.CastLike(op.Constant(value_float=math.nan), values), values),
                op.Where(has_nan, last_nan, indices))

    return pool


def batch_norm_no_training(input, weight=None, bias=None, running_mean=None, running_var=None,  # noqa: ANN001, ANN201
                           momentum: float = 0.9, eps: float = 1e-05):
    """``_native_batch_norm_legit_no_training``: torchlib's normalization, and the empty saved mean and rstd eager
    returns in eval (torchlib returned the running statistics, shape [C], where eager's are [0])."""
    from onnxscript.function_libs.torch_lib.ops import core

    norm, _, _ = core.aten__native_batch_norm_no_training(input, weight, bias, running_mean, running_var,
                                                           momentum, eps)
    empty = op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0])), input)
    return norm, empty, op.Identity(empty)


# Note [Constant slices as one node]
# torchlib's ``aten_slice`` casts and reshapes each bound (4 Casts, 4 Reshapes and their Constants per
# slice) and leaves the folding to the optimizer: ResNet-18's weight gradients hold ~150 slices, whose
# translation and folding took ~1.5 s of its 13 s first step. Bounds known when the graph is traced
# (Python ints, as every static slice's are) go straight into one Slice with constant inputs; ONNX
# Slice normalizes negative bounds and clamps ends past the size as ``aten.slice`` does. Symbolic
# bounds (a dynamic size) keep torchlib's form.
_INT64_MAX = 2**63 - 1


def slice_tensor(self, dim: int = 0, start=None, end=None, step=None):  # noqa: ANN001, ANN201
    """``aten.slice.Tensor`` with constant bounds as one ``Slice`` (Note [Constant slices as one node])."""
    bounds = (dim, start, end, step)
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in bounds):
        from onnxscript.function_libs.torch_lib.ops.core import aten_slice

        return getattr(aten_slice, "func", aten_slice)(self, dim, start, end, step)
    start = 0 if start is None else start
    end = _INT64_MAX if end is None else min(end, _INT64_MAX)
    return op.Slice(self, op.Constant(value_ints=[start]), op.Constant(value_ints=[end]),
                    op.Constant(value_ints=[dim]), op.Constant(value_ints=[1 if step is None else step]))


def assert_async(self, assert_msg: str = ""):  # noqa: ANN001, ANN201
    """``torch._assert_async(cond, msg)`` computes nothing in the graph: the exporter makes its condition a guard
    output that the runner checks after each run (Note [Value guards] in ``ortlab.onnx.guards``)."""
    return ()


def register(registry: object) -> None:
    """Add ortlab's translations to a torchlib registry (its custom ones win)."""
    aten = torch.ops.aten
    registry.register_op(aten.scalar_tensor.default, scalar_tensor)  # type: ignore[attr-defined]
    registry.register_op(aten.slice.Tensor, slice_tensor)  # type: ignore[attr-defined]
    registry.register_op(aten._native_batch_norm_legit_no_training.default,  # type: ignore[attr-defined]
                         batch_norm_no_training)
    for target in (aten._assert_async.msg, aten._assert_async.default):
        registry.register_op(target, assert_async)  # type: ignore[attr-defined]
    from ortlab.torchlib.integers import register as register_integers

    register_integers(registry)  # Note [Integer arithmetic stays integer]
    for target in (aten._unsafe_index_put.default, aten.index_put.default):
        registry.register_op(target, index_put_accumulate)  # type: ignore[attr-defined]
    nan_aware = {
        aten.amax.default: _reduce(op.ReduceMax),
        aten.amin.default: _reduce(op.ReduceMin),
        aten.max.default: _reduce_all(op.ReduceMax),
        aten.min.default: _reduce_all(op.ReduceMin),
        aten.max.dim: _with_index(op.ReduceMax, op.ArgMax),
        aten.min.dim: _with_index(op.ReduceMin, op.ArgMin),
        aten.argmax.default: _arg(op.ArgMax),
        aten.argmin.default: _arg(op.ArgMin),
    }
    from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

    nan_aware[aten.max_pool2d_with_indices.default] = _pool_with_nan(torchlib_nn.aten_max_pool2d_with_indices, 2)
    nan_aware[aten.max_pool3d_with_indices.default] = _pool_with_nan(torchlib_nn.aten_max_pool3d_with_indices, 3)
    for target, fn in nan_aware.items():
        registry.register_op(target, fn)  # type: ignore[attr-defined]
    from ortlab.torchlib.float_edges import register as register_float_edges

    register_float_edges(registry)  # Note [A norm whose variance overflows is NaN]
