"""Sizes, bytes and FLOPs of FX values at their example sizes.

Shared ground for the partitioner (bytes of saved activations) and the runtime (FLOPs
that choose a session's threads). Sizes may be symbolic (``dynamic=True``, or the
re-capture after a new size): these functions read a symbolic size's example value
(its hint) and never call ``int()`` on it, which would add a guard and re-capture for
every new size.
"""

from __future__ import annotations

import torch
import torch.fx

from ortlab.provenance import op_name

__all__ = ["UNKNOWN_SIZE", "size_hint", "numel", "value_bytes", "matmul_flops", "work_flops"]

# A data-dependent size (an unbacked SymInt, from nonzero() or item()) has no example
# value. 1024 stands for it everywhere: large enough that such a tensor counts as
# real work and real memory, never as free.
UNKNOWN_SIZE = 1024


def size_hint(size: int | torch.SymInt) -> int:
    """The example value of a (possibly symbolic) size; :data:`UNKNOWN_SIZE` if it has none.

    Example:
        >>> size_hint(7)
        7
    """
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else UNKNOWN_SIZE


def numel(t: torch.Tensor) -> int:
    """Elements of ``t`` at its example sizes."""
    n = 1
    for s in t.shape:
        n *= size_hint(s)
    return n


def value_bytes(val: object) -> tuple[tuple[int, ...], str, int]:
    """``(shape, dtype name, bytes)`` of an FX value; a non-tensor counts as 8 bytes.

    Example:
        >>> value_bytes(torch.zeros(2, 3))
        ((2, 3), 'float32', 24)
    """
    if not isinstance(val, torch.Tensor):
        return (), type(val).__name__, 8
    shape = tuple(size_hint(s) for s in val.shape)
    count = 1
    for s in shape:
        count *= s
    return shape, str(val.dtype).replace("torch.", ""), count * val.element_size()


_MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.convolution", "aten.baddbmm")


def matmul_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of the matrix products and convolutions of a graph, at its example sizes."""
    flops = 0
    for node in gm.graph.nodes:
        name = op_name(node)
        if name not in _MATMULS:
            continue
        val = node.meta.get("val")
        args = [a.meta.get("val") for a in node.all_input_nodes]
        if not isinstance(val, torch.Tensor) or not args or not all(isinstance(a, torch.Tensor) for a in args):
            continue
        if name == "aten.convolution" and len(args) > 1:
            k = numel(args[1]) // max(size_hint(args[1].shape[0]), 1)
        else:
            k = size_hint(args[-1].shape[-2])
        flops += 2 * numel(val) * k
    return flops


# Ops that move or relabel data without computing (their outputs are not counted as work).
_VIEWS = {"aten.view", "aten._unsafe_view", "aten.reshape", "aten.expand", "aten.t", "aten.transpose",
          "aten.permute", "aten.squeeze", "aten.unsqueeze", "aten.slice", "aten.select", "aten.alias",
          "aten.detach", "aten.as_strided"}


def work_flops(gm: torch.fx.GraphModule) -> int:
    """A graph's work at its example sizes: its matmuls' FLOPs (``matmul_flops``) and one FLOP for
    each element every other computing op produces.

    A graph without matmuls can still be large: the loss on the kept rows of a GPT-2-sized LM
    head is a log-softmax over 500 x 50,257 logits, which ran on one thread when only matmuls
    counted.
    """
    flops = matmul_flops(gm)
    for node in gm.graph.nodes:
        name = op_name(node)
        if node.op != "call_function" or name in _MATMULS or name in _VIEWS:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            flops += numel(val)
    return flops
