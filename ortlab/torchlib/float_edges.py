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
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op

__all__ = ["native_layer_norm", "native_group_norm", "register"]


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
