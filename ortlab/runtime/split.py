"""Run a graph whose ops are placed partly in onnxruntime and partly in PyTorch.

torch.fx's ``CapabilityBasedPartitioner`` groups the nodes onnxruntime runs into
partitions (``fused_0``, ``fused_1``...); each becomes one session, called from the
graph in place of its nodes, and the nodes placed in PyTorch (``ortlab.placement``)
run between them as they are. A graph with nothing placed in PyTorch is one session.

The callables follow AOTAutograd's boxed convention (one list argument, released as
soon as it is read), so inputs are freed while the graph runs.

Note [Random ops see eager's memory layout]
A random op (dropout) runs in PyTorch so that it draws eager's random numbers, but
``native_dropout`` fills its mask in the memory order of its input. onnxruntime returns
contiguous tensors, where eager's input may be a transposed view (the output of
``nn.MultiheadAttention`` with ``batch_first=True``): the same numbers then land on
other elements, and ``nn.TransformerEncoderLayer``'s ``dropout1`` differed from eager by
0.66. So each tensor a random op reads is given the dimension order it had in eager
(``node.meta["val"]``) first; a copy only when the order differs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from ortlab._compat.torch import OpOverload

__all__ = ["copy_graph", "split_graph", "boxed", "eager_layout", "as_traced_dtypes"]

# What turns one FX graph (the whole graph, or one partition) into a callable returning a list.
PartMaker = Callable[[torch.fx.GraphModule, str], Callable[..., list]]


class _Support(OperatorSupportBase):
    def __init__(self, in_pytorch: Collection[str]) -> None:
        super().__init__()
        self.in_pytorch = in_pytorch

    def is_node_supported(self, submodules: object, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.name in self.in_pytorch:
            return False
        if node.target is operator.getitem:  # keep a getitem with its producer (a getitem's item's too)
            src = node.args[0]
            return not (isinstance(src, torch.fx.Node) and src.op == "call_function"
                        and not self.is_node_supported(submodules, src))
        return True


class _OrtPart(torch.nn.Module):
    """A fused partition replaced by its onnxruntime session."""

    def __init__(self, runner: Callable[..., list], single: bool) -> None:
        super().__init__()
        self.runner = runner
        self.single = single

    def forward(self, *args: object) -> object:
        out = self.runner(*args)
        return out[0] if self.single else tuple(out)


def boxed(fn: Callable) -> Callable:
    """``fn(*args)`` as AOTAutograd's boxed callable ``run(args: list)``."""

    def run(args: list) -> object:
        return fn(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _boxed_runner(runner: Callable[..., list]) -> Callable:
    def run(args: list) -> list:
        out = runner(*args)
        args.clear()  # boxed convention: release inputs as soon as onnxruntime is done
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A fresh graph with the same node names and (shallow-copied) meta."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def _worth_running(node: torch.fx.Node) -> bool:
    return isinstance(node.target, OpOverload) and isinstance(node.meta.get("val"), torch.Tensor)


def _hint(s: int | torch.SymInt) -> int | None:
    if isinstance(s, torch.SymInt):
        hint = s.node.hint
        return int(hint) if isinstance(hint, int) else None
    return int(s)


def _dim_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """Dimensions from outermost to innermost in memory; None when a size is unbacked (data-dependent)."""
    # Symbolic sizes are read through their hints (this trace's values): int() on one would guard
    # it to that value, and Dynamo would re-capture the graph for every new size. The order of
    # strides does not change with the sizes, but for ties between dims of size 1.
    strides = [_hint(s) for s in t.stride()]
    sizes = [_hint(s) for s in t.shape]
    if None in strides or None in sizes:  # unbacked sizes: not decidable here
        return None
    return tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d], d)))


def eager_layout(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t`` with its dimensions laid out in memory in ``order`` (outermost first), as in eager."""
    if _dim_order(t) == order or t.numel() <= 1:
        return t
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return t.permute(order).contiguous().permute(inverse)


def _eager_layouts(gm: torch.fx.GraphModule, nodes: Collection[str]) -> dict[str, dict[int, tuple[int, ...]]]:
    """For each node of ``nodes``: the eager dimension order of each tensor argument that is not contiguous."""
    out: dict[str, dict[int, tuple[int, ...]]] = {}
    for node in gm.graph.nodes:
        if node.name not in nodes:
            continue
        for i, arg in enumerate(node.args):
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dim() > 1:
                order = _dim_order(val)
                if order is not None and order != tuple(range(val.dim())):
                    out.setdefault(node.name, {})[i] = order
    return out


# Note [Random ops keep eager's order]
# Random ops run in PyTorch so that they draw from the random stream as eager does; that
# holds only if they run in eager's order. The partitioner groups independent nodes, and a
# fused part is placed where its last node was: a part holding a T5 encoder op (needed by
# an encoder dropout) and a decoder op after the decoder's first dropout ran that encoder
# dropout after the decoder's, so T5 trained with other masks than eager (loss off by 0.14
# at the first step under the same seed). Parts are therefore cut at random ops: each part
# holds nodes from between the same two random ops (in the graph's order, which is eager's).
# Cutting a cycle-free partition this way cannot make a cycle: the nodes on any path between
# two nodes of one piece lie between them in the graph's order, so in the same piece or
# outside the partition.
def _between_random_ops(gm: torch.fx.GraphModule, partitions: list, random: Collection[str]) -> list:
    segment: dict[torch.fx.Node, int] = {}
    passed = 0
    for node in gm.graph.nodes:
        segment[node] = passed
        if node.name in random:
            passed += 1
    out = []
    for p in partitions:
        pieces: dict[int, list[torch.fx.Node]] = {}
        for node in p.nodes:
            pieces.setdefault(segment[node], []).append(node)
        for nodes in pieces.values():
            if any(_worth_running(n) for n in nodes):
                out.append(Partition(id=len(out), nodes=nodes))
    return out


# Note [Parts by depth]
# torch's CapabilityBasedPartitioner grows partitions by merging them pairwise, checking
# for a cycle at every merge: on a MobileNetV2's backward (~2,600 nodes, 17 depthwise
# convolution gradients in PyTorch) ``propose_partitions`` took 2-3.3 s of a 30 s first step
# (``benchmarks/split_graph.py``). The graphs split here are mostly onnxruntime's with a few
# ops in PyTorch, and for them one pass over the graph finds as few parts: a node's depth
# is the largest number of times a path from it to the graph's outputs goes from
# onnxruntime into PyTorch (a run of PyTorch ops counts once), and the onnxruntime nodes of
# one depth form one part, deepest first. No part can feed itself through PyTorch: a path
# that leaves a part through a PyTorch node arrives at a smaller depth, and depths never
# grow along a path, so the fused graph has no cycle. Counting towards the outputs puts a
# node that only reads the graph's inputs (a weight's transpose) in the part of its users,
# as torch's partitioner did (Note [Random ops keep eager's order] then keeps it whole). A
# part may hold unconnected pieces (independent branches between the same PyTorch ops):
# they run in one session. The items of an op's tuple output join the op's part (a
# tuple cannot cross into onnxruntime; moving them to an earlier part keeps the order
# sound, as their users stay where they were). torch's ``fuse_partitions`` still builds
# the parts.
def _partitions_by_depth(gm: torch.fx.GraphModule, support: OperatorSupportBase) -> list[Partition]:
    nodes = list(gm.graph.nodes)
    in_torch = {n for n in nodes if n.op == "call_function" and not support.is_node_supported({}, n)}
    depth: dict[torch.fx.Node, int] = {}
    for node in reversed(nodes):
        leaves = node.op == "call_function" and node not in in_torch  # onnxruntime -> PyTorch counts
        depth[node] = max((depth[u] + (leaves and u in in_torch) for u in node.users), default=0)
    by_depth: dict[int, list[torch.fx.Node]] = {}
    for node in nodes:
        if node.op != "call_function" or node in in_torch:
            continue
        src = node.args[0] if node.target is operator.getitem else None
        if isinstance(src, torch.fx.Node) and src.op == "call_function" and src not in in_torch:
            depth[node] = depth[src]  # a tuple never crosses between parts: its items stay with it
        by_depth.setdefault(depth[node], []).append(node)
    return [Partition(id=i, nodes=group) for i, (_, group) in enumerate(sorted(by_depth.items(), reverse=True))]


# Note [PyTorch's kernels return the traced dtypes]
# A graph is traced with fake tensors, whose dtypes come from torch's meta kernels; the CPU kernels
# do not always agree. Under bf16 autocast ``native_layer_norm``, ``native_group_norm`` and
# ``_native_batch_norm_legit_functional`` of a bf16 input with float32 weights return their
# statistics in float32 where the meta kernels say bf16 (torch 2.13). Run in PyTorch (onnxruntime's
# CPU provider has no bf16 LayerNormalization), such an op handed float32 to an onnxruntime part
# built for bf16: the backward of a Linear + LayerNorm under autocast crashed ("Unexpected input
# data type"). Each op run in PyTorch between parts therefore gives the graph the dtypes it was
# traced with: a tensor of another dtype is cast (nothing happens when they agree, which is every
# op outside autocast).
def _traced_dtypes(node: torch.fx.Node) -> object:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
        return tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in val)
    return None


def as_traced_dtypes(out: object, dtypes: object) -> object:
    """``out`` (a tensor, or a tuple of them) cast to the dtypes the graph was traced with, where they differ."""
    if isinstance(dtypes, torch.dtype):
        return out.to(dtypes) if isinstance(out, torch.Tensor) and out.dtype != dtypes else out
    if isinstance(out, (tuple, list)) and any(isinstance(t, torch.Tensor) and d is not None and t.dtype != d
                                              for t, d in zip(out, dtypes)):
        return type(out)(t.to(d) if isinstance(t, torch.Tensor) and d is not None and t.dtype != d else t
                         for t, d in zip(out, dtypes))
    return out


def _cast_to_traced_dtypes(gm: torch.fx.GraphModule, in_pytorch: Collection[str]) -> None:
    """After each op run in PyTorch, its outputs in the dtypes it was traced with (Note [PyTorch's kernels return
    the traced dtypes])."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.name not in in_pytorch or not isinstance(node.target, OpOverload):
            continue
        dtypes = _traced_dtypes(node)
        if dtypes is None or not node.users:
            continue
        with gm.graph.inserting_after(node):
            cast = gm.graph.call_function(as_traced_dtypes, (node, dtypes))
        node.replace_all_uses_with(cast, delete_user_cb=lambda user, cast=cast: user is not cast)


def split_graph(gm: torch.fx.GraphModule, in_pytorch: Collection[str], make_part: PartMaker,
                random: Collection[str] = ()) -> Callable:
    """A boxed callable running ``gm``: the nodes in ``in_pytorch`` in PyTorch, the rest in parts.

    ``make_part(graph, part_name)`` builds each onnxruntime part (``part_name`` is "" for
    the whole graph, ``fused_0``... for partitions). ``gm`` itself is not changed: export
    inserts type-promotion nodes and fusing partitions rewrites the graph, so the work is
    done on a copy (a retry starts from the graph AOTAutograd gave). The nodes of
    ``random`` (random ops, in PyTorch) read their tensors in eager's memory layout
    (see Note [Random ops see eager's memory layout]).
    """
    gm = copy_graph(gm)
    if not in_pytorch:
        return _boxed_runner(make_part(gm, ""))
    layouts = _eager_layouts(gm, random)
    support = _Support(in_pytorch)
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    partitions = _partitions_by_depth(gm, support)
    # Partitions of only getitems/size arithmetic are not worth a session.
    partitions = [p for p in partitions if any(_worth_running(n) for n in p.nodes)]
    if random:
        partitions = _between_random_ops(gm, partitions, random)
    fused = partitioner.fuse_partitions(partitions)
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and node.target.startswith("fused_"):
            sub = getattr(fused, node.target)
            out = next(n for n in sub.graph.nodes if n.op == "output")
            single = not isinstance(out.args[0], (tuple, list))
            if single:
                out.args = ((out.args[0],),)
                sub.recompile()
            setattr(fused, node.target, _OrtPart(make_part(sub, node.target), single))
    _cast_to_traced_dtypes(fused, in_pytorch)
    for node in list(fused.graph.nodes):
        for i, order in layouts.get(node.name, {}).items():
            with fused.graph.inserting_before(node):
                laid_out = fused.graph.call_function(eager_layout, (node.args[i], order))
            node.update_arg(i, laid_out)
    fused.recompile()
    return boxed(fused.forward)
