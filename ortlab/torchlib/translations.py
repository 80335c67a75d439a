"""ONNX translations ortlab adds to torchlib's registry, each for a real gap.

``index_put(..., accumulate=True)`` (an embedding's backward): torchlib emits
``ScatterND(reduction="add")``, which onnxruntime's CPU provider runs in parallel
and loses updates when indices repeat (gradients off by 10-30 on repeated tokens,
different on every run). ``ScatterElements(reduction="add")`` over the flattened
indices gives the exact sums, deterministically (checked against ``np.add.at``).
Only the embedding form (one index tensor on dim 0) is translated; other forms stay
in PyTorch with that reason (see ``ortlab.placement.KNOWN_WRONG``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from onnxscript import opset18 as op

__all__ = ["register", "is_single_index_accumulate"]


def is_single_index_accumulate(node: torch.fx.Node) -> bool:
    """``index_put(self, [idx], values, accumulate=True)`` with one index on dim 0."""
    indices = node.args[1] if len(node.args) > 1 else None
    return isinstance(indices, (list, tuple)) and len(indices) == 1 and indices[0] is not None


def index_put_accumulate(self, indices: Sequence, values, accumulate: bool = False):  # noqa: ANN001
    """Scatter-add ``values`` into ``self`` at ``indices[0]`` along dim 0."""
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


def register(registry: object) -> None:
    """Add ortlab's translations to a torchlib registry (its custom ones win)."""
    aten = torch.ops.aten
    for target in (aten._unsafe_index_put.default, aten.index_put.default):
        registry.register_op(target, index_put_accumulate)  # type: ignore[attr-defined]
