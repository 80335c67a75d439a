"""Forward/backward partitioning with activation recomputation (the memory optimizer).

We stay inside functorch's partitioner contract
``(joint, inputs, *, num_fwd_outputs) -> (fw, bw)`` and its recompute protocol:

* ``"none"``: ``default_partition`` (save what the backward needs, like eager);
* ``"auto"``: ``min_cut_rematerialization_partition`` (recompute cheap ops where
  that saves memory);
* ``"layerwise"`` and explicit selectors: tag nodes with
  ``node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE`` (and layer outputs
  with ``MUST_SAVE``) and let ``default_partition`` honour the tags, exactly as
  torch's selective activation checkpointing does.

Every plan reports each activation the no-recompute partition would save: what it
is, where it comes from, its bytes, and whether this plan recomputes it and why.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
from collections.abc import Sequence

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ortlab.config import BUDGET, describe_recompute, parse_budget, parse_recompute
from ortlab._compat.torch import (
    OpOverload, activation_memory_budget, default_partition, forward_region, min_cut_rematerialization_partition,
    without_symbols,
)
from ortlab.provenance import module_path, op_name, source_line
from ortlab.sizes import value_bytes

logger = logging.getLogger(__name__)

__all__ = ["SavedActivation", "RecomputePlan", "partition_joint"]

_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")
# Ops that only re-describe memory: free to recompute, and not what a user means by "the op".
_VIEW_OPS = {
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose", "aten.permute",
    "aten.expand", "aten.clone", "aten.detach", "aten.alias", "aten.squeeze", "aten.unsqueeze",
    "aten.slice", "aten.select",
}


def _producer(node: torch.fx.Node) -> torch.fx.Node:
    """The op behind a chain of views: ``view(gelu(x))`` -> the gelu node."""
    while (op_name(node) in _VIEW_OPS or node.target is operator.getitem) and node.args:
        if not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


def _tag_view_users(forward: list[torch.fx.Node], reasons: dict[str, str]) -> None:
    """Views of a recomputed node are recomputed with it (else they'd be saved instead)."""
    in_forward = set(forward)
    for node in forward:
        if node.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        for user in node.users:
            if user in in_forward and op_name(user) in _VIEW_OPS and user.meta.get("recompute") is None:
                user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                reasons.setdefault(user.name, reasons.get(node.name, "view of a recomputed node"))


@dataclasses.dataclass
class SavedActivation:
    """One tensor the forward graph would hand to the backward graph."""

    name: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    module: str
    source: str
    recomputed: bool
    reason: str = ""
    output_index: int | None = None  # which output of a multi-output op (native_layer_norm: 0, 1, 2)

    @property
    def label(self) -> str:
        """What a user knows it as: ``blocks.0.ln1: LayerNorm output``, ``blocks.0.attn: softmax``.

        The FX node name (``getitem_2``) stays in ``name``, for the graphs and netron.
        """
        what = _WHAT.get((self.op, self.output_index)) or _WHAT.get((self.op, None))
        if what is None:
            short = self.op.split(".")[-1].lstrip("_")
            what = f"{short} output" if self.output_index in (None, 0) else f"{short} output {self.output_index}"
        return f"{self.module or '<root>'}: {what}"


# Names of saved activations by (op, output index); None: any output.
_WHAT: dict[tuple[str, int | None], str] = {
    ("aten.native_layer_norm", 0): "LayerNorm output",
    ("aten.native_layer_norm", 1): "LayerNorm mean",
    ("aten.native_layer_norm", 2): "LayerNorm inv std",
    ("aten.native_group_norm", 0): "GroupNorm output",
    ("aten.native_group_norm", 1): "GroupNorm mean",
    ("aten.native_group_norm", 2): "GroupNorm inv std",
    ("aten.native_batch_norm", 0): "BatchNorm output",
    ("aten._native_batch_norm_legit_functional", 0): "BatchNorm output",
    ("aten._native_batch_norm_legit_functional", 1): "BatchNorm mean",
    ("aten._native_batch_norm_legit_functional", 2): "BatchNorm inv std",
    ("aten.native_dropout", 0): "dropout output",
    ("aten.native_dropout", 1): "dropout mask",
    ("aten._softmax", None): "attention softmax",
    ("aten._log_softmax", None): "log-softmax",
    ("aten.gelu", None): "GELU output",
    ("aten.relu", None): "ReLU output",
    ("aten.tanh", None): "tanh output",
    ("aten.sigmoid", None): "sigmoid output",
    ("aten.mm", None): "matmul output",
    ("aten.addmm", None): "linear output",
    ("aten.bmm", None): "batched matmul output",
    ("aten.embedding", None): "embedding output",
    ("aten.clone", None): "copy",
    ("aten.arange", None): "positions (arange)",
    ("aten.convolution", None): "convolution output",
    ("aten.max_pool2d_with_indices", 1): "max-pool indices",
}


@dataclasses.dataclass
class RecomputePlan:
    """What a partition saves and recomputes.

    Attributes:
        policy: the recompute option that produced it.
        activations: every activation the no-recompute partition saves.
        saved_bytes: bytes the chosen partition actually saves (at the example sizes).
        baseline_bytes: bytes the no-recompute partition saves.
        rejected: rows of the policy (``"+gelu_3"``) left out, and why (see Note [Rows never add bytes]).
        note: why the plan is not the policy's own, when it is not (Note [A preset never saves more than none]),
            or how a budget was met (Note [A memory budget]).
        budget_bytes: the budget in bytes, for ``("budget", ...)``.
        recompute_flops: the predicted cost of the recomputation: FLOPs of the ops the backward
            recomputes (torch's flop counter; one per output element for the ops it does not count).
        forward_flops: FLOPs of the forward by the same count, to put ``recompute_flops`` in proportion.
        recompute_us: the recomputation's predicted microseconds a step, where a profile measured the
            module's kernels (``ORTModule.note_kernel_times``); 0 without one.
    """

    policy: str
    activations: list[SavedActivation]
    saved_bytes: int
    baseline_bytes: int
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""
    budget_bytes: int | None = None
    recompute_flops: int = 0
    forward_flops: int = 0
    recompute_us: float = 0.0

    @property
    def cost(self) -> str:
        """The predicted cost in words: ``recomputes 1.2 MFLOP (3.4% of the forward)``."""
        if not self.recompute_flops:
            return "recomputes nothing"
        share = f" ({self.recompute_flops / self.forward_flops:.1%} of the forward)" if self.forward_flops else ""
        timed = f", about {self.recompute_us:,.0f} us a step by measured kernel times" if self.recompute_us else ""
        return f"recomputes {_flops(self.recompute_flops)}{share}{timed}"

    @property
    def recomputed(self) -> list[SavedActivation]:
        return [a for a in self.activations if a.recomputed]

    def table(self, max_rows: int | None = None) -> str:
        """A plain-text table of the saved activations, largest first when cut to ``max_rows``
        (whole rows only, and a last line saying how many were left out)."""
        chosen = self.activations
        if max_rows is not None and len(chosen) > max_rows:
            chosen = sorted(chosen, key=lambda a: -a.bytes)[:max_rows]
        rows = [("name", "op", "shape", "dtype", "bytes", "module", "recomputed")]
        for a in chosen:
            rows.append((a.name, a.op, "x".join(map(str, a.shape)) or "scalar", a.dtype, f"{a.bytes:,}", a.module or "-", "yes" if a.recomputed else "no"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
        if len(chosen) < len(self.activations):
            text += f"\n... {len(self.activations) - len(chosen)} smaller activations not shown (table() lists all)"
        return text


def _saved_nodes(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    saved = list(out.args[0])[num_fwd_outputs:]
    return [n.name for n in saved if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]


def _layer_of(node: torch.fx.Node) -> str | None:
    m = _LAYER.match(module_path(node))
    return m.group(1) if m else None


def _recomputable(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    tensors = isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val)
    )
    if node.op != "call_function" or not tensors:
        return False
    target = node.target
    if isinstance(target, OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
            return False
    return True


def _forward_nodes(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> list[torch.fx.Node]:
    """Nodes of the joint graph the forward outputs depend on, in graph order."""
    out = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    stack = [n for n in flat[:num_fwd_outputs] if isinstance(n, torch.fx.Node)]
    needed: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in joint.graph.nodes if n in needed and n.op not in ("placeholder", "output")]


def _tag_layerwise(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> dict[str, str]:
    """Recompute everything inside each repeated layer (``<path>.<index>``), save layer outputs."""
    reasons = {}
    for node in _forward_nodes(joint, num_fwd_outputs):
        layer = _layer_of(node)
        if layer is None or not _recomputable(node):
            continue
        leaves_layer = any(_layer_of(u) != layer for u in node.users if u.op != "output")
        if leaves_layer:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            reasons[node.name] = f"layerwise: inside layer {layer}, recomputed from the layer's input"
    return reasons


def _matches(node: torch.fx.Node, sel: str) -> bool:
    if sel.startswith("op:"):
        return op_name(_producer(node)) == sel[3:] or str(node.target).startswith(sel[3:])
    if sel.startswith("module:"):
        path = module_path(node)
        return path == sel[7:] or path.startswith(sel[7:] + ".")
    return node.name == sel


def _tag_selected(joint: torch.fx.GraphModule, num_fwd_outputs: int, selectors: Sequence[str],
                  policy: CheckpointPolicy = CheckpointPolicy.MUST_RECOMPUTE,
                  prefix: str = "selected by") -> dict[str, str]:
    reasons: dict[str, str] = {}
    forward = _forward_nodes(joint, num_fwd_outputs)
    for node in forward:
        if not _recomputable(node):
            continue
        for sel in selectors:
            if _matches(node, sel):
                node.meta["recompute"] = policy
                reasons[node.name] = f"{prefix} {sel!r}"
                break
    if policy == CheckpointPolicy.MUST_RECOMPUTE:
        _tag_view_users(forward, reasons)
    return reasons


def _tags(joint: torch.fx.GraphModule) -> dict[torch.fx.Node, object]:
    return {n: n.meta.get("recompute") for n in joint.graph.nodes}


def _restore(tags: dict[torch.fx.Node, object]) -> None:
    for node, tag in tags.items():
        if tag is None:
            node.meta.pop("recompute", None)
        else:
            node.meta["recompute"] = tag


# In PyTorch a saved view shares its base's storage; in onnxruntime a view op (Reshape,
# Transpose) that is a graph output is a copy, and a Transpose kept for the backward
# cannot fold into the Gemm/MatMul that uses it (transA/transB). So the forward hands
# the backward the view's base, and the backward re-applies the view, where onnxruntime
# fuses it into its consumer. Same bytes saved, fewer copies.
_REBUILT_VIEWS = _VIEW_OPS - {"aten.clone"}


def _used_by_backward(joint: torch.fx.GraphModule) -> list[str]:
    """The nodes ``default_partition`` would save, without building its graphs (~0.25 s
    on a 4-layer GPT): its forward region (every non-tangent node up to the last one
    tagged forward, the original placement) read from outside that region."""
    nodes = list(joint.graph.nodes)
    forward = forward_region(joint)
    return [
        n.name
        for n in nodes
        if n in forward and n.op == "call_function" and any(u not in forward and u.op != "output" for u in n.users)
    ]


def _tag_saved_views(joint: torch.fx.GraphModule, saved: Sequence[str]) -> bool:
    """Tag saved views (and views of views) to be rebuilt in the backward; True if any."""
    nodes = {n.name: n for n in joint.graph.nodes}
    tagged = False
    for name in saved:
        node = nodes.get(name)
        while node is not None and op_name(node) in _REBUILT_VIEWS and node.meta.get("recompute") is None:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged = True
            base = node.args[0] if node.args else None
            node = base if isinstance(base, torch.fx.Node) and base.op != "placeholder" else None
    return tagged


def _save_recompute_inputs(joint: torch.fx.GraphModule) -> None:
    """A recomputed node's untagged inputs must be saved, or the backward cannot rebuild it.

    ``default_partition`` only saves nodes with direct backward users; a node whose
    only backward-side consumer is a recomputed node would otherwise be lost.
    """
    for node in joint.graph.nodes:
        if node.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        for inp in node.all_input_nodes:
            if inp.op == "placeholder" or inp.meta.get("recompute") is not None:
                continue
            if isinstance(inp.meta.get("val"), (tuple, list)):
                # A getitem of a multi-output op (native_layer_norm) that is not
                # recomputed: save the getitem's own output instead of the tuple.
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            else:
                inp.meta["recompute"] = CheckpointPolicy.MUST_SAVE


# Note [A preset never saves more than none]
# torch's min-cut partitioner chooses what to save by its own cost model, and on a 2-layer
# nn.TransformerEncoder recompute="auto" saved 10.7 MB where the partition without recompute saves 9.7 MB:
# more memory and more work, silently. A plan that saves more bytes than the no-recompute partition is
# replaced by that one, with a note in the plan (the report and the toggles show it) and a warning.

# Note [Rows never add bytes]
# A row added to a preset ("+ln_2") recomputes one more activation, but what it is rebuilt
# from must then be saved; inside a layerwise plan those inputs were themselves recomputed,
# and the toggles once went from 238,852 to 764,932 saved bytes (and 2.26x slower) for one
# ticked row. So rows are added one at a time on top of the preset, each kept only if the
# partition it gives saves no more bytes than without it; a row that would is left out, with
# the bytes it would have cost, in ``RecomputePlan.rejected``. One partition per row
# (~0.1-0.3 s each), at capture time only.
def _add_rows(joint: torch.fx.GraphModule, num_fwd_outputs: int, added: Sequence[str], reasons: dict[str, str],
              rejected: dict[str, str], split, fw: torch.fx.GraphModule,  # noqa: ANN001
              bw: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    best = _fw_saved_bytes(fw, num_fwd_outputs)
    for sel in added:
        before = _tags(joint)
        row_reasons = _tag_selected(joint, num_fwd_outputs, [sel], prefix="added by")
        if not row_reasons:
            rejected[sel] = "matches no activation that can be recomputed"
            continue
        try:
            new_fw, new_bw = split()
        except Exception as e:  # noqa: BLE001 - a row the partitioner cannot honour is left out, said why
            _restore(before)
            rejected[sel] = f"the partitioner could not recompute it: {str(e).splitlines()[0][:200]}"
            continue
        new_bytes = _fw_saved_bytes(new_fw, num_fwd_outputs)
        if new_bytes > best:
            _restore(before)
            rejected[sel] = (f"recomputing it would save {new_bytes - best:,} more bytes: what it is rebuilt from "
                             "would have to be saved instead")
            continue
        best, fw, bw = new_bytes, new_fw, new_bw
        reasons.update(row_reasons)
    return fw, bw


def _flops(n: float) -> str:
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} FLOP"


def _node_flops(node: torch.fx.Node, memo: dict[str, int] | None = None) -> int:
    """FLOPs of one op at its example sizes: torch's flop counter (matmuls, convolutions,
    attention), else one per output element (elementwise ops, reductions, norms)."""
    from torch.utils.flop_counter import FlopCounterMode

    if memo is not None and node.name in memo:
        return memo[node.name]
    if node.op != "call_function" or node.target is operator.getitem or op_name(node) in _VIEW_OPS:
        return 0
    elements, counted = 0, 0
    try:
        # sizes by their hints: a guard here would specialize a symbolic capture (Note in without_symbols)
        val = node.meta.get("val")
        elements = sum(without_symbols(v).numel() for v in (val if isinstance(val, (tuple, list)) else [val])
                       if isinstance(v, torch.Tensor))
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: without_symbols(a.meta.get("val")))
        with FlopCounterMode(display=False) as mode:
            node.target(*args, **kwargs)
        counted = mode.get_total_flops()
    except Exception:  # noqa: BLE001 - an op the counter cannot replay counts one per output element, or nothing
        pass
    flops = int(counted) or int(elements)
    if memo is not None:
        memo[node.name] = flops
    return flops


def _recomputed(bw: torch.fx.GraphModule, forward_names: set[str],
                joint_nodes: dict[str, torch.fx.Node]) -> list[torch.fx.Node]:
    """The forward ops a backward graph recomputes (the partitioners copy them under their names)."""
    return [joint_nodes[n.name] for n in bw.graph.nodes
            if n.op == "call_function" and n.name in forward_names and n.name in joint_nodes]


class _Cost:
    """What recomputing an op costs: its FLOPs, or, where a profile measured its kernel, that time in
    FLOP-equivalents at the rate the measured ops ran (Note [A memory budget]).

    ``measured`` maps FX node names to microseconds per run (``ORTModule.note_kernel_times``)."""

    def __init__(self, forward: list[torch.fx.Node], measured: dict[str, float] | None) -> None:
        self.memo: dict[str, int] = {}
        self.measured = {n.name: measured[n.name] for n in forward if measured and n.name in measured}
        flops = sum(_node_flops(n, self.memo) for n in forward if n.name in self.measured)
        us = sum(self.measured.values())
        self.rate = flops / us if us > 0 and flops > 0 else 0.0  # FLOPs per microsecond of the measured ops

    def of(self, node: torch.fx.Node) -> float:
        if self.rate and node.name in self.measured:
            return self.measured[node.name] * self.rate
        return float(_node_flops(node, self.memo))

    def us(self, node: torch.fx.Node) -> float:
        """Predicted microseconds: measured, or FLOPs at the measured rate."""
        if node.name in self.measured:
            return self.measured[node.name]
        return _node_flops(node, self.memo) / self.rate if self.rate else 0.0


# Note [A memory budget]
# recompute=("budget", 0.5) or ("budget", "300MB") asks for the least recomputation whose saved
# activations fit: half the bytes the partition without recompute saves, or 300 MB. The cost is the
# FLOPs of the recomputed ops (torch's flop counter). Candidates, each a real partition whose saved bytes
# we count as ortlab's saved_bytes (what the forward graph hands the backward):
# * torch's own answer: the min-cut partitioner takes an activation memory budget and picks what to save
#   by a 0-1 knapsack over FLOPs (torch._functorch.config.activation_memory_budget). Its budget is a
#   fraction between "save only the inputs" and the min-cut's own choice, in its own byte estimate, and it
#   only trades the nodes its rules let it recompute; so we bisect its fraction against our bytes.
# * checkpointing the first k repeated layers (layerwise on blocks.0 .. blocks.k-1), k bisected: it reaches
#   far below the knapsack (on a 3-layer GPT the knapsack stops at 74% of the bytes; layers go to ~20%).
# * recomputing every forward op that can be: the smallest reachable.
# The fitting candidate with the least recompute cost wins: FLOPs, refined by measured times where a profile
# measured the ops' kernels (``ORTModule.note_kernel_times``, which the monitor's profile windows call): a
# measured op costs its microseconds at the rate the measured ops ran, so an op slower than its FLOPs say
# (a Gather, a Softmax on a 2-core CPU) weighs what it takes. If none fits, the smallest is used and the
# note gives its bytes. Random ops (dropout) are never recomputed: torch's knapsack (and a recomputed
# getitem of native_dropout) would redraw them (gradients off by 0.14 on a GPT with dropout 0.1), so they are tagged
# MUST_SAVE first, and a candidate whose backward still holds a random op is left out. The min-cut
# partitioner leaves marks on the joint graph that make later default_partition calls ignore the tags, so
# the tagged candidates are built first. Recomputation replays the same ops on the same values: results
# equal no recompute's (bitwise on a 3-layer GPT, or within 6e-9 where onnxruntime fuses differently).
def _fit_budget(joint: torch.fx.GraphModule, joint_inputs: Sequence[object], num_fwd_outputs: int, value: object,
                base: tuple[torch.fx.GraphModule, torch.fx.GraphModule], kwargs: dict,
                measured: dict[str, float] | None = None,
                ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, str, int, dict[str, str]]:
    none = _fw_saved_bytes(base[0], num_fwd_outputs)
    kind, amount = parse_budget(value)
    target = int(amount * none) if kind == "fraction" else int(amount)
    if none <= target:
        return (*base, f"without recompute the saved activations take {none:,} bytes, within the budget "
                       f"({target:,}): nothing is recomputed", target, {})
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    forward = _forward_nodes(joint, num_fwd_outputs)
    forward_names = {n.name for n in forward}
    random = set()
    for node in forward:  # never a fresh random draw in the backward: save a random op's outputs
        if isinstance(node.target, OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
            # a multi-output op (native_dropout) is saved through its getitems: default_partition skips tuples
            outs = [u for u in node.users if u.target is operator.getitem] if isinstance(node.meta.get("val"), (tuple, list)) else [node]
            for out in outs:
                out.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                random.add(out)
    tags = _tags(joint)
    cost = _Cost(forward, measured)
    # name -> (bytes, cost, fw, bw, reasons)
    tried: dict[str, tuple[int, float, torch.fx.GraphModule, torch.fx.GraphModule, dict[str, str]]] = {}

    def keep(name: str, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, reasons: dict[str, str]) -> int:
        _restore(tags)
        if any(isinstance(n.target, OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
               for n in bw.graph.nodes):  # a fresh random draw in the backward: wrong gradients, no candidate
            logger.debug("budget candidate %s left out: it recomputes a random op", name)
            return none + 1
        nbytes = _fw_saved_bytes(fw, num_fwd_outputs)
        tried[name] = (nbytes, sum(cost.of(n) for n in _recomputed(bw, forward_names, joint_nodes)), fw, bw, reasons)
        logger.debug("budget candidate %s: %d bytes, cost %.0f", name, nbytes, tried[name][1])
        return nbytes

    def knapsack(fraction: float) -> int:
        with activation_memory_budget(fraction):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        return keep(f"knapsack {fraction:.3g}", fw, bw, {})

    def tagged(name: str, chosen: list[torch.fx.Node], why: str) -> int:
        reasons = {}
        for node in chosen:
            # over the baseline's MUST_SAVE of views' bases (random ops are not _recomputable)
            if node not in random and node.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE and _recomputable(node):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                reasons[node.name] = why
        _tag_view_users(forward, reasons)
        _save_recompute_inputs(joint)
        try:
            fw, bw = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        except Exception as e:  # noqa: BLE001 - a candidate the partitioner cannot build is no candidate
            logger.debug("budget candidate %s left out: %s", name, e)
            _restore(tags)
            return none + 1
        return keep(name, fw, bw, reasons)

    tagged("all", forward, "budget: every forward op that can be is recomputed (the smallest reachable)")
    # the first k repeated layers checkpointed: the smallest k that fits
    layers = list(dict.fromkeys(layer for n in forward if (layer := _layer_of(n)) is not None))

    def first_layers(k: int) -> int:
        inside = [n for n in forward if _layer_of(n) in layers[:k]
                  and not any(_layer_of(u) != _layer_of(n) for u in n.users if u.op != "output")]
        return tagged(f"layers {k}", inside, f"budget: layers {layers[0]}..{layers[k - 1]} recomputed from their inputs")

    if layers and first_layers(len(layers)) <= target:
        lo, hi = 0, len(layers)  # none (k=0) does not fit; all layers do
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if first_layers(mid) <= target else (mid, hi)
    # torch's knapsack: the largest fraction that fits (fewest FLOPs); 1.0 is min-cut's own plan
    if knapsack(1.0) > target and knapsack(0.01) <= target:
        lo, hi = 0.01, 1.0
        for _ in range(4):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if knapsack(mid) <= target else (lo, mid)
    fits = [t for t in tried.values() if t[0] <= target]
    if fits:
        nbytes, _, fw, bw, reasons = min(fits, key=lambda t: (t[1], t[0]))
        how = (f"; ranked by measured kernel times ({len(cost.measured)} ops measured), FLOPs for the rest"
               if cost.rate else "; ranked by FLOPs (no kernel profile yet)")
        return fw, bw, (f"budget {target:,} bytes: saves {nbytes:,} of {none:,} bytes "
                        f"({nbytes / none:.0%} of the partition without recompute){how}"), target, reasons
    nbytes, _, fw, bw, reasons = min(tried.values(), key=lambda t: (t[0], t[1]))
    note = (f"the budget ({target:,} bytes) cannot be met: the smallest reachable is {nbytes:,} bytes "
            f"({nbytes / none:.0%} of the {none:,} saved without recompute), used instead")
    logger.warning("ortlab: %s", note)
    return fw, bw, note, target, reasons


def _output_index(node: torch.fx.Node | None) -> int | None:
    if node is not None and node.target is operator.getitem and isinstance(node.args[1], int):
        return node.args[1]
    return None


def _fw_saved_bytes(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    nodes = {n.name: n for n in fw.graph.nodes}
    total = 0
    for name in _saved_nodes(fw, num_fwd_outputs):
        node = nodes.get(name)
        if node is not None and _producer(node).op != "placeholder":
            total += value_bytes(node.meta.get("val"))[2]
    return total


def partition_joint(
    joint: torch.fx.GraphModule,
    joint_inputs: Sequence[object],
    num_fwd_outputs: int,
    policy: str | Sequence[str],
    measured: dict[str, float] | None = None,
    **kwargs: object,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, RecomputePlan]:
    """Split ``joint`` into forward and backward graphs under a recompute policy.

    ``measured``: microseconds per run of FX nodes' kernels, from a profile; a budget ranks its plans by
    them where known (Note [A memory budget]).

    Returns the forward graph, the backward graph and the plan describing what is
    saved and recomputed.
    """
    nodes = {n.name: n for n in joint.graph.nodes}
    # The baseline ("none") already hands the backward views' bases instead of the views.
    if _tag_saved_views(joint, _used_by_backward(joint)):
        _save_recompute_inputs(joint)
    base_fw, base_bw = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    baseline = _saved_nodes(base_fw, num_fwd_outputs)
    reasons: dict[str, str] = {}
    rejected: dict[str, str] = {}
    preset, added, removed = parse_recompute(policy)
    note = ""
    budget_bytes = None

    def split() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        _save_recompute_inputs(joint)
        if preset == "auto":  # the min-cut partitioner honours the tags, as in selective checkpointing
            return min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    if preset == "none" and not added and not removed:
        fw, bw = base_fw, base_bw
    else:
        if preset == "layerwise":
            reasons = _tag_layerwise(joint, num_fwd_outputs)
        if removed:
            kept = _tag_selected(joint, num_fwd_outputs, removed, CheckpointPolicy.MUST_SAVE, "saved by")
            for name in kept:
                reasons.pop(name, None)
        if preset == BUDGET:  # Note [A memory budget]
            if added:
                _tag_selected(joint, num_fwd_outputs, added, prefix="added by")
                _save_recompute_inputs(joint)
            fw, bw, note, budget_bytes, reasons = _fit_budget(joint, joint_inputs, num_fwd_outputs, list(policy)[1],
                                                              (base_fw, base_bw), kwargs, measured)
        else:
            fw, bw = split()
        if added and preset != BUDGET:
            fw, bw = _add_rows(joint, num_fwd_outputs, added, reasons, rejected, split, fw, bw)
        chosen, none = _fw_saved_bytes(fw, num_fwd_outputs), _fw_saved_bytes(base_fw, num_fwd_outputs)
        if chosen > none:  # Note [A preset never saves more than none]
            note = (f"recompute={describe_recompute(policy)!r} would save {chosen:,} bytes, more than without "
                    f"recompute ({none:,}); the partition without recompute is used")
            logger.warning("ortlab: %s", note)
            fw, bw, reasons = base_fw, base_bw, {}
    saved = set(_saved_nodes(fw, num_fwd_outputs))
    activations = []
    for name in baseline:
        node = nodes.get(name)
        if node is not None and _producer(node).op == "placeholder":
            continue  # a view of a parameter or input: alive anyway, not an activation
        val = (node.meta.get("val") if node is not None else None)
        shape, dtype, nbytes = value_bytes(val)
        recomputed = name not in saved
        default = ("min-cut partitioner: cheaper to recompute than to save" if preset == "auto"
                   else f"{describe_recompute(policy)}: torch's knapsack, the fewest FLOPs to recompute that fit"
                   if preset == BUDGET else "not saved: the backward reads a later value computed from it")
        reason = reasons.get(name, default if recomputed else "")
        activations.append(
            SavedActivation(
                name=name,
                op=op_name(_producer(node)) if node is not None else "?",
                shape=shape,
                dtype=dtype,
                bytes=nbytes,
                module=module_path(_producer(node)) if node is not None else "",
                source=source_line(_producer(node)) if node is not None else "",
                recomputed=recomputed,
                reason=reason,
                output_index=_output_index(node),
            )
        )
    saved_bytes = _fw_saved_bytes(fw, num_fwd_outputs)
    # FLOPs only where something may be recomputed: the counter replays every forward op (~1 s on large graphs)
    forward = [] if fw is base_fw else _forward_nodes(joint, num_fwd_outputs)
    cost = _Cost(forward, measured)
    rebuilt = _recomputed(bw, {n.name for n in forward}, nodes) if forward else []
    plan = RecomputePlan(
        budget_bytes=budget_bytes,
        recompute_us=sum(cost.us(n) for n in rebuilt) if cost.rate else 0.0,
        recompute_flops=sum(_node_flops(n, cost.memo) for n in rebuilt),
        forward_flops=sum(_node_flops(n, cost.memo) for n in forward),
        policy=describe_recompute(policy),
        note=note,
        rejected=rejected,
        activations=activations,
        saved_bytes=saved_bytes,
        baseline_bytes=sum(a.bytes for a in activations),
    )
    return fw, bw, plan
