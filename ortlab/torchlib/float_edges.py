"""Translations that keep PyTorch's NaN where a float32 statistic overflows (the decompositions for the other
edges of floating point are in ``ortlab.capture.float_edges``).

Note [A norm whose variance overflows is NaN]
onnxruntime's LayerNormalization (and the InstanceNormalization torchlib builds ``group_norm`` from)
computes a float32 row's variance in float32; where it overflows (finite data spread wider than about
1.8e19) 1/std is 0 and the row came out all zeros, its gradients zeros: a layer whose activations had
blown up trained on silently. PyTorch's CPU kernels (``RowwiseMoments``: Welford in float32, lanes of 8
or 16 combined at the end) give NaN for such rows wherever the row's mean squared overflows or the row
ends in a partial vector, and zeros otherwise, by row length and the CPU's vector width. ortlab gives NaN
for every row whose variance overflows: the output, the saved 1/std, and so every gradient through it,
never zeros (so where PyTorch's kernel happens to give zeros, e.g. a zero-mean row of 768, ortlab differs:
NaN). ``x * (r / r)`` is x where r = 1/std is finite and non-zero, NaN where it is 0 (or inf: ``eps = 0``
and a constant row, which PyTorch makes NaN too). One broadcast multiply of the output: 0.17 -> 0.22 ms
for a LayerNormalization of [8, 128, 256] on 2 threads, well under 0.1% of the GPT benchmark's step.
float64 norms are traced through torch's decompositions and are exact. (``nn.BatchNorm``'s CPU kernel
in training gives zeros for such a channel itself, as ortlab's decomposition does; ``var`` and ``std``
are Note [float32 variances in float64] in ``ortlab.capture.float_edges``.)

Note [A sum of negative zeros is +0.0]
PyTorch's sum and mean start from +0.0, so a sum whose terms are all -0.0 is +0.0; onnxruntime's
ReduceSum and ReduceMean start from the first term where the reduced axes are innermost, and give -0.0
there (``full((5, 2), -0.0).sum(1)``; over an outer axis +0.0). Such sums are what broadcasting's
gradients reduce to (``sum_to_size``): a margin_ranking_loss gradient, a ``%`` by a broadcast tensor,
whose masked terms are -0.0, came back -0.0 where eager's is +0.0. A float ``sum`` or ``mean`` adds
+0.0 to its result (-0.0 + 0.0 is +0.0; every other value is unchanged, NaN and inf included); one
Add over the reduced output. ortlab's no-op rules keep ``x + 0.0`` (Note [Adding zero keeps the sign
of zero] in ``ortlab._compat.onnxscript``) and onnxruntime's NoopElimination stays off
(``ortlab.runtime.fusions``).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op

__all__ = ["native_layer_norm", "native_group_norm", "plus_zero", "register"]


def plus_zero(x, self, dtype: int | None = None):  # noqa: ANN001, ANN201
    """``x + 0.0`` where ``x``, a reduction of ``self`` (to ``dtype`` when given), is real floating point
    (Note [A sum of negative zeros is +0.0]); other values as they are."""
    to = ir.DataType(dtype) if dtype is not None and dtype != -1 else getattr(self, "dtype", None)
    if to is None or not to.is_floating_point():
        return x
    return op.Add(x, op.Constant(value=ir.tensor(0.0, dtype=to)))


def _func(torchlib_op: object) -> object:
    """A torchlib op's Python function (traced in place, as ortlab's own translations are)."""
    return getattr(torchlib_op, "func", torchlib_op)


def native_layer_norm(input, normalized_shape, weight=None, bias=None,  # noqa: ANN001, ANN201, A002
                      eps: float = 1e-05):
    """torchlib's LayerNormalization, its rows NaN where the float32 variance overflows (see the module's Note)."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_native_layer_norm

    result, mean, rstd = _func(aten_native_layer_norm)(input, normalized_shape, weight, bias, eps)
    if input.dtype != ir.DataType.FLOAT:
        return result, mean, rstd
    finite = op.Div(rstd, rstd)  # 1, or NaN where 1/std is 0
    return op.Mul(result, finite), mean, op.Mul(rstd, finite)


def native_group_norm(input, weight=None, bias=None, N=None, C=None,  # noqa: ANN001, ANN201, A002, N803
                      HxW=None, group: int = 1, eps: float = 1e-05):  # noqa: ANN001, N803
    """torchlib's group norm, its groups NaN where the float32 variance overflows (see the module's Note)."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_native_group_norm

    result, mean, rstd = _func(aten_native_group_norm)(input, weight, bias, N, C, HxW, group, eps)
    if input.dtype != ir.DataType.FLOAT:
        return result, mean, rstd
    finite = op.Div(rstd, rstd)  # [N, group]
    grouped = op.Reshape(result, op.Concat(op.Shape(input, start=0, end=1), op.Constant(value_ints=[group, -1]),
                                           axis=0))
    grouped = op.Mul(grouped, op.Unsqueeze(finite, op.Constant(value_ints=[2])))
    return op.Reshape(grouped, op.Shape(input)), mean, op.Mul(rstd, finite)


def register(registry: object) -> None:
    """Add these translations to a torchlib registry (ortlab's custom ones win)."""
    import torch

    aten = torch.ops.aten
    registry.register_op(aten.native_layer_norm.default, native_layer_norm)  # type: ignore[attr-defined]
    registry.register_op(aten.native_group_norm.default, native_group_norm)  # type: ignore[attr-defined]
    from onnxscript.function_libs.torch_lib.ops import core

    def mean(self, dtype: int | None = None):  # noqa: ANN001, ANN202
        return plus_zero(core.aten_mean(self, dtype=-1 if dtype is None else dtype), self, dtype)

    def mean_dim(self, dim=None, keepdim: bool = False, dtype: int | None = None):  # noqa: ANN001, ANN202
        return plus_zero(core.aten_mean_dim(self, dim, keepdim, dtype=-1 if dtype is None else dtype), self, dtype)

    registry.register_op(aten.mean.default, mean)  # type: ignore[attr-defined]
    registry.register_op(aten.mean.dim, mean_dim)  # type: ignore[attr-defined]
