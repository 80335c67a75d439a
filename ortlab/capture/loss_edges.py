"""Losses at their edges as PyTorch's kernels: the inputs they refuse, and the mean of an empty batch.

Note [A loss refuses what PyTorch's kernel refuses]
PyTorch's ``binary_cross_entropy`` checks every element, input first and then target, and raises
``RuntimeError: all elements of input should be between 0 and 1`` (or ``... of target ...``) for the
first element outside ``[0, 1]`` (NaN included). torch's decomposition computes the loss without
checking: a target of 2.0 gave a loss of 0.52 through onnxruntime, an input of 1.5 a NaN. The
decomposition here states both checks as ``torch._assert_async(no element failed, PyTorch's
message)``, which the exporter turns into guards checked after the run (Note [Value guards] in
``ortlab.onnx.guards``). Which message is PyTorch's depends on the first failing element: the input's
check fails where some input is out of range with no target out of range before it (a running count of
the targets out of range), the target's where any target is. The backward checks nothing, as
PyTorch's.

Note [The mean loss of an empty batch is NaN]
``mse_loss`` with ``reduction="mean"`` of an empty batch is NaN in PyTorch (0 / 0); torchlib's
``ReduceMean`` gives 0, a finite loss where eager's is NaN (the other losses reach ``mean`` and its
Note [The mean of nothing is NaN] in ``ortlab.capture.decompositions``). Where the batch is known to be
empty the loss is NaN; any other size keeps the op. The backward of ``mse_loss``, ``smooth_l1_loss`` and
``huber_loss`` of an empty batch is an empty gradient: torch's decompositions of their backward divide by
the number of elements in Python (``ZeroDivisionError`` while AOTAutograd traced, and the whole graph
ran in PyTorch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ortlab._compat.torch import OpOverload, assert_on_device, aten_decompositions

__all__ = ["binary_cross_entropy_checked", "mse_loss_of_nothing", "loss_backward_of_nothing", "loss_edge_decompositions"]

aten = torch.ops.aten
_MEAN = 1  # torch.nn._reduction's "mean"
_INPUT = "all elements of input should be between 0 and 1"
_TARGET = "all elements of target should be between 0 and 1"


def _known_empty(x: torch.Tensor) -> bool:
    """``x`` has no elements, known without guarding a symbolic size."""
    numel = x.numel()
    return isinstance(numel, int) and numel == 0


def _outside_unit(x: torch.Tensor) -> torch.Tensor:
    """Elements outside ``[0, 1]``, NaN included, flattened."""
    return ((x >= 0) & (x <= 1)).logical_not().reshape(-1)


def binary_cross_entropy_checked(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                                 reduction: int = _MEAN) -> object:
    """torch's ``binary_cross_entropy`` decomposition after PyTorch's checks of its input and target (Note [A loss
    refuses what PyTorch's kernel refuses])."""
    bad_input, bad_target = _outside_unit(self), _outside_unit(target)
    if statically_known_true(bad_input.numel() == bad_target.numel()):  # the first failing element decides
        targets_before = bad_target.cumsum(0) - bad_target.long()
        input_first = (bad_input & (targets_before == 0)).any()
    else:
        input_first = bad_input.any()
    # ``torch._assert_async``, traced into the graph (the one spelling, in ortlab._compat.torch)
    assert_on_device(input_first.logical_not(), _INPUT)
    assert_on_device(bad_target.any().logical_not(), _TARGET)
    return aten_decompositions[aten.binary_cross_entropy.default](self, target, weight, reduction)


def mse_loss_of_nothing(self: torch.Tensor, target: torch.Tensor, reduction: int = _MEAN) -> object:
    """``mse_loss``'s mean over no elements as NaN (Note [The mean loss of an empty batch is NaN]); ``NotImplemented``
    (the op) otherwise."""
    if reduction != _MEAN or not (_known_empty(self) or _known_empty(target)):  # (sizes compared would guard them)
        return NotImplemented
    return ((self - target) * (self - target)).sum() + float("nan")


def loss_backward_of_nothing(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                             *args: object) -> object:
    """The gradient of a pointwise loss (``mse``, ``smooth_l1``, ``huber``) of an empty batch: empty (Note [The mean
    loss of an empty batch is NaN]); ``NotImplemented`` (the op's decomposition) otherwise."""
    if not _known_empty(self):
        return NotImplemented
    return torch.zeros_like(self)


def loss_edge_decompositions() -> dict[OpOverload, Callable]:
    """This module's decompositions, by the op each is traced for."""
    return {
        aten.binary_cross_entropy.default: binary_cross_entropy_checked,
        aten.mse_loss.default: mse_loss_of_nothing,
        aten.mse_loss_backward.default: loss_backward_of_nothing,
        aten.smooth_l1_loss_backward.default: loss_backward_of_nothing,
        aten.huber_loss_backward.default: loss_backward_of_nothing,
    }
