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

from ortlab._compat.torch import (MULTI_MARGIN_TARGETS, MULTILABEL_MARGIN_TARGETS, SDPA_TARGETS, SOFTSHRINK_TARGETS,
                                  aot_module_simplified)
from ortlab.capture.decompositions import (decomposition_table, multi_margin_loss, multi_margin_loss_c, prod_call,
                                           multilabel_margin_loss, sdpa_math)
from ortlab.capture.float_edges import softshrink_call
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


# Note [Attention dropout on CUDA stays in PyTorch's kernel]
# On CUDA, eager PyTorch runs ``scaled_dot_product_attention`` with dropout in a fused kernel
# (memory-efficient or flash attention) that draws its mask inside the kernel from its own Philox
# offsets. The math form draws its mask with ``native_dropout``: other numbers, so losses and
# gradients differed from eager's by the changed masks (1.2e-4 relative on a small GPT's loss on an
# H200; RoBERTa's embedding gradient by 5.3e-3), silently. On the CPU, eager's SDPA with dropout is
# the math form, the same draws. So on CUDA an SDPA call that may drop (``dropout_p`` not the constant
# 0) and takes no mask (``is_causal`` or none: GPT-style attention) is kept: AOTAutograd traces
# PyTorch's fused kernel and its backward, both tagged as drawing from the random stream, and they run
# in PyTorch, reported as random ops (``ortlab.placement``). With a mask (Hugging Face's attention),
# the fused kernel kept so failed at run time on an H200 ("(*bias): last dimension must be
# contiguous", Mistral): that call takes the math form, and the report's hint says that its dropout
# masks are not eager's (the same probability, other positions).
CUDA_MASKED_DROPOUT_HINT = (
    "on CUDA, {n} attention call(s) with dropout and a mask draw their dropout masks with native_dropout, "
    "where eager PyTorch's fused attention kernel draws its own: the dropped positions (not their "
    "probability) differ from eager's, and so do losses and gradients. Attention without a mask "
    "(is_causal) or without dropout keeps eager's numbers (Note [Attention dropout on CUDA stays in "
    "PyTorch's kernel], ortlab/capture/aot.py)")


def _may_drop(node: torch.fx.Node) -> bool:
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return not (isinstance(p, (int, float)) and p == 0)


def _has_mask(node: torch.fx.Node) -> bool:
    return node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None) is not None


def rewrite_calls(gm: torch.fx.GraphModule, device: torch.device | None = None,
                  hints: list[str] | None = None) -> int:
    """Replace fused SDPA calls by their math form (see ``decompositions``; on CUDA not those with dropout and
    no mask, Note [Attention dropout on CUDA stays in PyTorch's kernel]; ``hints`` gets a line where masked
    ones with dropout take it), multilabel margin losses by
    theirs (Note [Multilabel margin loss with its target slots masked]), softshrink by its vector path's form
    (Note [softshrink's zeros as PyTorch's vector path]), prod by its eager gradient's (Note [prod's gradient
    as eager's]), and masked writes of one row by a
    ``where`` (Note [A masked write of one row is a where]); returns how many."""
    count = masked_dropouts = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            if device is not None and device.type == "cuda" and _may_drop(node):
                if not _has_mask(node):
                    continue
                masked_dropouts += 1
            node.target = sdpa_math
            count += 1
        elif node.op == "call_function" and node.target in MULTILABEL_MARGIN_TARGETS:
            node.target = multilabel_margin_loss
            count += 1
        elif node.op == "call_function" and node.target in MULTI_MARGIN_TARGETS:
            # Note [Margin losses' gradients as PyTorch's kernels]
            node.target = multi_margin_loss if node.target is torch.nn.functional.multi_margin_loss \
                else multi_margin_loss_c
            count += 1
        elif (node.op == "call_function" and node.target is torch.prod) or \
                (node.op == "call_method" and node.target == "prod"):
            node.op, node.target = "call_function", prod_call  # Note [prod's gradient as eager's]
            count += 1
        elif node.op == "call_function" and node.target in SOFTSHRINK_TARGETS:
            node.target = softshrink_call  # Note [softshrink's zeros as PyTorch's vector path]
            count += 1
        elif node.op == "call_function" and _one_row_masked_write(node):
            node.target = masked_write
            count += 1
    if count:
        gm.recompile()
    if masked_dropouts and hints is not None:
        hints.append(CUDA_MASKED_DROPOUT_HINT.format(n=masked_dropouts))
    return count


def graph_device(example_inputs: Sequence[object]) -> torch.device:
    """The one device a captured graph's tensors live on (CPU for a graph without tensors;
    ``meta`` when every tensor is a meta tensor).

    Raises:
        DeviceError: when the graph mixes devices.
    """
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        devices.discard(torch.device("meta"))  # a meta tensor beside real ones holds no data to move
    if len(devices) > 1:
        # PyTorch lets a 0-d CPU tensor meet tensors on another device (a plain tensor attribute that
        # model.cuda() leaves behind); the runner says where each input is (Note [CPU tensors among a
        # CUDA graph's inputs] in ortlab.runtime.runner).
        devices = {t.device for t in tensors if t.device.type != "meta" and not (t.device.type == "cpu" and t.dim() == 0)}
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
