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
import re
from collections.abc import Sequence

import torch
import torch.fx
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

from ortlab.capture.provenance import module_path, op_name, source_line

__all__ = ["SavedActivation", "RecomputePlan", "partition_joint"]

_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


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


@dataclasses.dataclass
class RecomputePlan:
    """What a partition saves and recomputes.

    Attributes:
        policy: the recompute option that produced it.
        activations: every activation the no-recompute partition saves.
        saved_bytes: bytes the chosen partition actually saves (at the example sizes).
        baseline_bytes: bytes the no-recompute partition saves.
    """

    policy: str
    activations: list[SavedActivation]
    saved_bytes: int
    baseline_bytes: int

    @property
    def recomputed(self) -> list[SavedActivation]:
        return [a for a in self.activations if a.recomputed]

    def table(self) -> str:
        """A plain-text table of the saved activations."""
        rows = [("name", "op", "shape", "dtype", "bytes", "module", "recomputed")]
        for a in self.activations:
            rows.append((a.name, a.op, "x".join(map(str, a.shape)) or "scalar", a.dtype, f"{a.bytes:,}", a.module or "-", "yes" if a.recomputed else "no"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def _hint(size: int | torch.SymInt) -> int:
    """The example value of a (possibly symbolic) size."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else 1


def _nbytes(val: object) -> tuple[tuple[int, ...], str, int]:
    if not isinstance(val, torch.Tensor):
        return (), type(val).__name__, 8
    shape = tuple(_hint(s) for s in val.shape)
    numel = 1
    for s in shape:
        numel *= s
    return shape, str(val.dtype).replace("torch.", ""), numel * val.element_size()


def _saved_nodes(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    saved = list(out.args[0])[num_fwd_outputs:]
    return [n.name for n in saved if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]


def _layer_of(node: torch.fx.Node) -> str | None:
    m = _LAYER.match(module_path(node))
    return m.group(1) if m else None


def _recomputable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
            return False
    return True


def _forward_nodes(joint: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes of the joint graph that do not depend on a tangent (the forward part)."""
    backward: set[torch.fx.Node] = set()
    nodes = []
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            if "tangents" in node.name:
                backward.add(node)
            continue
        if node.op == "output":
            continue
        if any(isinstance(a, torch.fx.Node) and a in backward for a in node.all_input_nodes):
            backward.add(node)
            continue
        nodes.append(node)
    return nodes


def _tag_layerwise(joint: torch.fx.GraphModule) -> dict[str, str]:
    """Recompute everything inside each repeated layer (``<path>.<index>``), save layer outputs."""
    reasons = {}
    for node in _forward_nodes(joint):
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


def _tag_selected(joint: torch.fx.GraphModule, selectors: Sequence[str]) -> dict[str, str]:
    reasons = {}
    for node in _forward_nodes(joint):
        if not _recomputable(node):
            continue
        for sel in selectors:
            if sel.startswith("op:"):
                hit = op_name(node) == sel[3:] or str(node.target).startswith(sel[3:])
            elif sel.startswith("module:"):
                path = module_path(node)
                hit = path == sel[7:] or path.startswith(sel[7:] + ".")
            else:
                hit = node.name == sel
            if hit:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                reasons[node.name] = f"selected by {sel!r}"
                break
    return reasons


def partition_joint(
    joint: torch.fx.GraphModule,
    joint_inputs: Sequence[object],
    num_fwd_outputs: int,
    policy: str | Sequence[str],
    **kwargs: object,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, RecomputePlan]:
    """Split ``joint`` into forward and backward graphs under a recompute policy.

    Returns the forward graph, the backward graph and the plan describing what is
    saved and recomputed.
    """
    nodes = {n.name: n for n in joint.graph.nodes}
    base_fw, base_bw = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    baseline = _saved_nodes(base_fw, num_fwd_outputs)
    reasons: dict[str, str] = {}
    if policy == "none":
        fw, bw = base_fw, base_bw
    elif policy == "auto":
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    else:
        reasons = _tag_layerwise(joint) if policy == "layerwise" else _tag_selected(joint, policy)
        fw, bw = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    saved = set(_saved_nodes(fw, num_fwd_outputs))
    activations = []
    for name in baseline:
        node = nodes.get(name)
        val = (node.meta.get("val") if node is not None else None)
        shape, dtype, nbytes = _nbytes(val)
        recomputed = name not in saved
        reason = reasons.get(name, "min-cut partitioner: cheaper to recompute than to save" if recomputed else "")
        activations.append(
            SavedActivation(
                name=name,
                op=op_name(node) if node is not None else "?",
                shape=shape,
                dtype=dtype,
                bytes=nbytes,
                module=module_path(node) if node is not None else "",
                source=source_line(node) if node is not None else "",
                recomputed=recomputed,
                reason=reason,
            )
        )
    saved_bytes = 0
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    for name in saved:
        saved_bytes += _nbytes(fw_nodes[name].meta.get("val"))[2] if name in fw_nodes else 0
    plan = RecomputePlan(
        policy=policy if isinstance(policy, str) else ",".join(policy),
        activations=activations,
        saved_bytes=saved_bytes,
        baseline_bytes=sum(a.bytes for a in activations),
    )
    return fw, bw, plan
