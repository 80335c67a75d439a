"""Prepare Dynamo's graph and trace it with AOTAutograd into the joint, forward and backward graphs.

Dynamo gives us, for free and correct: guards (a new input structure, a changed
Python scalar, a changed module attribute, train/eval or grad-mode switches all
re-capture instead of returning a stale result), graph breaks (the code between
captured graphs runs in PyTorch), and symbolic sizes. AOTAutograd gives the joint
forward+backward graph and, at run time, stitches the compiled forward and backward
into PyTorch autograd (``loss.backward()`` fills ``.grad`` of the real parameters;
buffer mutations such as BatchNorm running stats are written back every step).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx

from ortlab._compat.torch import MULTILABEL_MARGIN_TARGETS, SDPA_TARGETS, aot_module_simplified
from ortlab.capture.decompositions import decomposition_table, multilabel_margin_loss, sdpa_math
from ortlab.errors import DeviceError

__all__ = ["rewrite_calls", "masked_write", "graph_device", "trace"]

Compiler = Callable[[torch.fx.GraphModule, Sequence[object]], Callable]


# Note [A masked write of one row is a where]
# ``x[mask] = v`` with a bool mask is an ``index_put`` that AOTAutograd traces through ``nonzero``
# (the selected rows' count is data-dependent), and its gradient indexes by the mask again: the
# capture failed ("DynamicOutputShapeException: aten.nonzero") and the whole graph ran in PyTorch.
# Masking tokens with a learned embedding writes one row (``h[mask] = self.mask_token``), which
# broadcasts to every selected row whatever their count: that is ``x.copy_(where(mask, v, x))``,
# in place as the write was (views of ``x`` see it), with the same values and gradients. A value
# with one row per selected row (its count known only at run time) keeps the write.


def masked_write(x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> None:
    """``x[mask] = value`` for a bool ``mask`` over ``x``'s leading dims and a ``value`` of one row (Note [A masked
    write of one row is a where])."""
    rows = mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
    if value.dim() > x.dim() - mask.dim():
        value = value.squeeze(0)
    x.copy_(torch.where(rows, value.to(x.dtype), x))


def _one_row_masked_write(node: torch.fx.Node) -> bool:
    """``setitem(x, mask, value)`` that :func:`masked_write` computes: static sizes, the mask over leading dims,
    the value one row (or a leading 1 and one row) that broadcasts to a row of ``x``."""
    if node.target is not operator.setitem or len(node.args) != 3:
        return False
    x, mask, value = (a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in node.args)
    if not all(isinstance(t, torch.Tensor) for t in (x, mask, value)) or mask.dtype != torch.bool:
        return False
    sizes = (*x.shape, *mask.shape, *value.shape)
    if any(not isinstance(n, int) for n in sizes) or tuple(mask.shape) != tuple(x.shape[:mask.dim()]):
        return False
    row = tuple(x.shape[mask.dim():])
    shape = tuple(value.shape)
    if len(shape) == len(row) + 1 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) > len(row):
        return False
    try:
        return torch.broadcast_shapes(shape, row) == row
    except RuntimeError:
        return False


def rewrite_calls(gm: torch.fx.GraphModule) -> int:
    """Replace fused SDPA calls by their math form (see ``decompositions``), multilabel margin losses by
    theirs (Note [Multilabel margin loss with its target slots masked]), and masked writes of one row by a
    ``where`` (Note [A masked write of one row is a where]); returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            node.target = sdpa_math
            count += 1
        elif node.op == "call_function" and node.target in MULTILABEL_MARGIN_TARGETS:
            node.target = multilabel_margin_loss
            count += 1
        elif node.op == "call_function" and _one_row_masked_write(node):
            node.target = masked_write
            count += 1
    if count:
        gm.recompile()
    return count


def graph_device(example_inputs: Sequence[object]) -> torch.device:
    """The one device a captured graph's tensors live on (CPU for a graph without tensors;
    ``meta`` when every tensor is a meta tensor).

    Raises:
        DeviceError: when the graph mixes devices.
    """
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        devices.discard(torch.device("meta"))  # a meta tensor beside real ones holds no data to move
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise DeviceError(
            f"the captured graph mixes tensors on {names}; ortlab runs one graph on one device. "
            "Move the module and all inputs to the same device (module.to(device), x.to(device))."
        )
    return devices.pop() if devices else torch.device("cpu")


def trace(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    *,
    forward: Compiler,
    backward: Compiler,
    inference: Compiler,
    partition: Callable[..., tuple[torch.fx.GraphModule, torch.fx.GraphModule]],
    cache_dir: str | None = None,
) -> Callable:
    """AOTAutograd on ``gm`` with ortlab's decompositions: returns the callable Dynamo runs.

    ``partition`` is a functorch partitioner (``(joint, inputs, *, num_fwd_outputs) ->
    (fw, bw)``); the compilers get the forward, backward and no-grad graphs.
    """
    return aot_module_simplified(
        gm,
        example_inputs,
        fw_compiler=forward,
        bw_compiler=backward,
        inference_compiler=inference,
        decompositions=decomposition_table(cache_dir),
        partition_fn=partition,
    )
